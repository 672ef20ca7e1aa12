"""A fake Linux sysfs tree for GPUs and InfiniBand/RoCE NICs, built from a `nvidia-smi topo -m` dump.

`build_fake_sysfs(root, dump, gpu_bus_ids)` writes, under `root`:

    sys/devices/pci0000:<hb>/<root port>/<upper switch up>/<upper switch down>/<leaf switch up>/<leaf switch down>/<bdf>/numa_node
    sys/bus/pci/devices/<bdf>            -> symlink to the device directory above (GPUs and NICs)
    sys/class/infiniband/mlx5_N/device   -> symlink to the NIC's device directory

The directory chain encodes the PCIe hierarchy so that the relation of any NIC to any GPU (and NIC to NIC) that
discovery derives from the paths is the dump's cell. Groups are found by union-find per level over the dump's
GPU-NIC, NIC-NIC and PCIe GPU-GPU cells: same NUMA node (cell NODE or closer), same host bridge (PHB or closer),
same upper PCIe switch (PXB or closer), same leaf switch (PIX). Each host-bridge group gets its own PCI root, each
upper-switch group its own root port and switch, each leaf group its own switch below it.

NUMA nodes: a GPU's `numa_node` is the dump's NUMA affinity (first node). A NIC gets the NUMA node of the GPUs it
is NODE (or closer) to; when that node would also make it NODE to a GPU the dump says is SYS to it (a dump that is
not NUMA-consistent, e.g. a PCIe box whose GPUs are SYS to a NIC on their own socket), or when it relates to no GPU,
it gets a node number no GPU uses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.core.topo_dump import TopoDump, is_nvlink, link_rank

# PCI buses of the GPUs on an 8-GPU HGX baseboard, as NVML shows them (the simulated agent uses the same).
HGX_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
_LEVELS = ("NODE", "PHB", "PXB", "PIX")


def default_gpu_bus_ids(count: int) -> list[str]:
    """NVML-style bus ids ("00000000:18:00.0") for `count` GPUs."""
    return [f"00000000:{(HGX_BUSES[i] if count <= len(HGX_BUSES) else 0x10 + i):02X}:00.0" for i in range(count)]


def sysfs_bdf(bus_id: str) -> str:
    """ "00000000:18:00.0" -> "0000:18:00.0" (the sysfs spelling)."""
    domain, bus, devfn = bus_id.strip().split(":")
    return f"{int(domain, 16):04x}:{bus.lower()}:{devfn.lower()}"


def natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def ib_names(dump: TopoDump) -> dict[str, str]:
    """Dump NIC column -> InfiniBand device name (from the NIC Legend; "mlx5_<i>" when the dump has none)."""
    out = {}
    for i, nic in enumerate(dump.nics):
        out[nic] = dump.nic_device(nic) or f"mlx5_{i}"
    return out


class _UnionFind:
    def __init__(self, items):
        self.parent = {x: x for x in items}

    def find(self, x):
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def groups(self, items) -> list[list]:
        out: dict = {}
        for x in items:
            out.setdefault(self.find(x), []).append(x)
        return list(out.values())


@dataclass
class FakeSysfs:
    root: Path
    bdf: dict[str, str] = field(default_factory=dict)  # device ("GPU0", "NIC3") -> sysfs bdf
    numa: dict[str, int] = field(default_factory=dict)  # device -> numa_node written
    ib: dict[str, str] = field(default_factory=dict)  # dump NIC column -> mlx5_N
    paths: dict[str, Path] = field(default_factory=dict)  # device -> its directory under sys/devices


class _Alloc:
    """Unique fake BDFs: bridges use device numbers 1..31, endpoints device 0 on buses no GPU uses."""

    def __init__(self, gpu_buses: set[int]):
        self._bridge = 0
        self._free_buses = [b for b in range(1, 256) if b not in gpu_buses]

    def bridge(self) -> str:
        bus, dev = divmod(self._bridge, 31)
        self._bridge += 1
        return f"0000:{bus:02x}:{dev + 1:02x}.0"

    def endpoint(self) -> str:
        return f"0000:{self._free_buses.pop(0):02x}:00.0"


def build_fake_sysfs(root: str | Path, dump: TopoDump, gpu_bus_ids: list[str] | None = None) -> FakeSysfs:
    """Write the fake sysfs tree for `dump` under `root` and describe it."""
    root = Path(root)
    gpus, nics = dump.gpus, dump.nics
    gpu_bus_ids = list(gpu_bus_ids or default_gpu_bus_ids(len(gpus)))
    devices = gpus + nics
    alloc = _Alloc({int(b.split(":")[1], 16) for b in gpu_bus_ids})
    result = FakeSysfs(root=root, ib=ib_names(dump))
    for g, bus in zip(gpus, gpu_bus_ids, strict=True):
        result.bdf[g] = sysfs_bdf(bus)
    for n in nics:
        result.bdf[n] = alloc.endpoint()

    def cell(a: str, b: str) -> str | None:
        value = dump.cell(a, b)
        if value is None or is_nvlink(value):
            return None
        return value

    ufs = {level: _UnionFind(devices) for level in _LEVELS}
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            value = cell(a, b)
            if value is None:
                continue
            for level in _LEVELS:
                if link_rank(value) >= link_rank(level):
                    ufs[level].union(a, b)

    # NUMA nodes.
    gpu_numa = {g: dump.numa_node(g) for g in gpus}
    numa: dict[str, int] = dict(gpu_numa)
    used = {n for n in gpu_numa.values() if n >= 0}
    fresh = max(used, default=-1) + 1
    for group in ufs["NODE"].groups(devices):
        group_nics = [d for d in group if d in nics]
        if not group_nics:
            continue
        known = [gpu_numa[g] for g in group if g in gpu_numa and gpu_numa[g] >= 0]
        node = known[0] if known else None
        if node is not None:
            clash = any(
                gpu_numa[g] == node and g not in group and cell(g, n) is not None for g in gpus for n in group_nics
            )
            if clash:
                node = None
        if node is None:
            node, fresh = fresh, fresh + 1
        for n in group_nics:
            numa[n] = node
        for g in group:
            if g in gpu_numa and gpu_numa[g] < 0 and known:
                numa[g] = node
    result.numa = numa

    # PCIe hierarchy.
    devices_dir = root / "sys" / "devices"
    hb_of = {d: ufs["PHB"].find(d) for d in devices}
    hb_index = {r: i for i, r in enumerate(dict.fromkeys(hb_of[d] for d in devices))}
    upper: dict = {}  # PXB group root -> (root port, upper switch upstream port) directory
    leaf: dict = {}  # PIX group root -> leaf switch upstream port directory
    for d in devices:
        hb = devices_dir / f"pci0000:{hb_index[hb_of[d]]:02x}"
        up_key = ufs["PXB"].find(d)
        if up_key not in upper:
            upper[up_key] = hb / alloc.bridge() / alloc.bridge()
        leaf_key = ufs["PIX"].find(d)
        if leaf_key not in leaf:
            leaf[leaf_key] = upper[up_key] / alloc.bridge() / alloc.bridge()
        path = leaf[leaf_key] / alloc.bridge() / result.bdf[d]
        path.mkdir(parents=True, exist_ok=True)
        (path / "numa_node").write_text(f"{numa.get(d, -1)}\n")
        (path / "class").write_text("0x030200\n" if d in gpus else "0x020700\n")
        result.paths[d] = path
        link = root / "sys" / "bus" / "pci" / "devices" / result.bdf[d]
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(path, link.parent), link)
    for n in nics:
        ib_dir = root / "sys" / "class" / "infiniband" / result.ib[n]
        ib_dir.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(result.paths[n], ib_dir), ib_dir / "device")
    return result
