"""Real GPU discovery through NVML (nvidia-ml-py's `pynvml`).

`discover_topology(node_name)` returns the same proto HostTopology a simulated host gives: GPU count, UUIDs,
model names, memory, PCI bus ids, compute capability, MIG mode and MIG instances from NVML, NUMA nodes from sysfs;
GPU-to-GPU cells from NVLink state (links to a peer GPU counted per pair; enabled links into NVSwitches make every
pair of switch-attached GPUs NV<links>) and otherwise from nvmlDeviceGetTopologyCommonAncestor
(PIX/PXB/PHB/NODE/SYS); the multi-node NVLink fabric (cluster UUID, clique) from nvmlDeviceGetGpuFabricInfo.

NICs are not visible to NVML: they come from sysfs, `<root>/sys/class/infiniband/<dev>/device` (InfiniBand and
RoCE devices), named NIC0, NIC1, ... in natural order of their device names (as `nvidia-smi topo -m` does). A
NIC's relation to a GPU or another NIC follows from their PCI paths under `<root>/sys/devices` (see `pci_relation`).
Only when sysfs shows no NIC at all and `nvidia-smi` is on PATH does its `topo -m` table supply the NIC rows.

Both sources are parameters (`nvml`: the pynvml module or a stand-in such as phalanx.testing.fake_nvml.FakeNvml;
`sysfs_root`: "/" or a fake tree from phalanx.testing.fake_sysfs), so the code that runs on real hosts is the code
the tests run.

Importing this module never needs a GPU; discovery on a host without a driver or GPU raises DiscoveryError with
a message that says so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.topo_dump import TopoDump, TopoParseError, parse_topo

from .topology import topology_from_dump

log = structlog.get_logger()

# nvmlDeviceGetTopologyCommonAncestor levels -> `nvidia-smi topo -m` words.
_ANCESTOR_WORDS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class DiscoveryError(RuntimeError):
    """GPU discovery is impossible here (no driver, no NVML library, no GPU)."""


def normalize_bus_id(bus_id: str | bytes) -> str:
    """"0000:18:00.0" / "00000000:18:00.0" -> "00000000:18:00.0"."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    bus_id = bus_id.strip().rstrip("\x00")
    parts = bus_id.split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
        try:
            return f"{int(domain, 16):08X}:{bus.upper()}:{devfn.upper()}"
        except ValueError:
            pass
    return bus_id.upper()


def _str(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def sysfs_bdf(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" -> sysfs's "0000:18:00.0"."""
    domain, bus, devfn = normalize_bus_id(bus_id).split(":")
    return f"{int(domain, 16):04x}:{bus.lower()}:{devfn.lower()}"


@dataclass
class PciDevice:
    """A PCI device in sysfs: its bdf, its chain under /sys/devices ("pci0000:00", bridges..., itself), NUMA node."""

    bdf: str
    chain: tuple[str, ...] | None
    numa: int


def _read_int(path: Path, default: int = -1) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def _pci_device(sysfs_root: Path, device_dir: Path, bdf: str = "") -> PciDevice:
    chain = None
    try:
        real = Path(os.path.realpath(device_dir))
        rel = real.relative_to(Path(os.path.realpath(sysfs_root / "sys" / "devices")))
        if rel.parts and rel.parts[0].startswith("pci"):
            chain = tuple(rel.parts)
        bdf = bdf or real.name
    except (OSError, ValueError):
        pass
    return PciDevice(bdf=bdf, chain=chain, numa=_read_int(device_dir / "numa_node"))


def gpu_pci_device(sysfs_root: str | Path, bus_id: str) -> PciDevice:
    bdf = sysfs_bdf(bus_id)
    root = Path(sysfs_root)
    return _pci_device(root, root / "sys" / "bus" / "pci" / "devices" / bdf, bdf)


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def sysfs_nics(sysfs_root: str | Path) -> list[tuple[str, PciDevice]]:
    """(device name, PCI device) of each InfiniBand/RoCE device under <root>/sys/class/infiniband, in natural order."""
    root = Path(sysfs_root)
    base = root / "sys" / "class" / "infiniband"
    try:
        names = sorted((p.name for p in base.iterdir()), key=_natural_key)
    except OSError:
        return []
    return [(name, _pci_device(root, base / name / "device")) for name in names]


def _switches(chain: tuple[str, ...], k: int) -> set[tuple[str, ...]]:
    """The PCIe switches the bridges chain[k:] belong to. chain[0] is the PCI root, chain[1] the root port, then
    switch upstream/downstream ports in pairs; a switch is named by the chain down to its upstream port."""
    out = set()
    for i in range(max(k, 2), len(chain)):
        up = 2 + 2 * ((i - 2) // 2)
        out.add(chain[: up + 1])
    return out


def pci_relation(a: PciDevice, b: PciDevice) -> str:
    """The `nvidia-smi topo -m` word for two PCI devices from their sysfs paths.

    Same PCI root (host bridge): PIX when the path between them crosses at most one PCIe switch, PXB when it crosses
    several switches without the host bridge, PHB when it goes through the host bridge (different root ports).
    Different roots: NODE when both are on the same (known) NUMA node, else SYS.
    """
    if a.chain and b.chain and a.chain[0] == b.chain[0]:
        ba, bb = a.chain[:-1], b.chain[:-1]   # bridges above each device (root first)
        k = 0
        while k < min(len(ba), len(bb)) and ba[k] == bb[k]:
            k += 1
        # k: common prefix (root, root port, ...). The path turns at ba[k-1].
        if k <= 2:
            return "PHB"   # they meet at the root or the root port: through the host bridge
        crossed = _switches(ba, k - 1) | _switches(bb, k - 1)
        return "PIX" if len(crossed) <= 1 else "PXB"
    if a.numa >= 0 and a.numa == b.numa:
        return "NODE"
    return "SYS"


def _nvidia_smi_dump(timeout: float = 15.0) -> TopoDump | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout, check=True).stdout
        return parse_topo(out)
    except (OSError, subprocess.SubprocessError, TopoParseError) as exc:
        log.warning("nvidia_smi_topo_unavailable", error=str(exc))
        return None


def _load_pynvml():
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DiscoveryError("nvidia-ml-py (pynvml) is not installed") from exc
    return pynvml


def discover_topology(
    node_name: str = "",
    use_nvidia_smi: bool = True,
    *,
    nvml=None,
    sysfs_root: str | Path = "/",
) -> agent_pb2.HostTopology:
    """Discover this host's GPUs through NVML and its NICs through sysfs. Raises DiscoveryError when there is no
    usable driver or GPU. `nvml` defaults to the real pynvml module, `sysfs_root` to "/"."""
    nv = nvml if nvml is not None else _load_pynvml()
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise DiscoveryError(
            f"cannot initialise NVML ({exc}): no NVIDIA driver or GPU on this host? "
            "Use --simulate PROFILE or --simulate-from DUMPFILE to run a simulated host."
        ) from exc
    try:
        return _discover(nv, use_nvidia_smi, Path(sysfs_root))
    except nv.NVMLError as exc:
        raise DiscoveryError(f"NVML query failed: {exc}") from exc
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def _optional(nv, fn_name: str, *args):
    """An NVML call that older drivers or some GPUs lack: None on NVMLError or when pynvml has no such function."""
    fn = getattr(nv, fn_name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _mig(nv, handle, index: int, name: str, memory_mib: int):
    """(GpuInfo.MigMode, [GpuInfo.MigInstance]) of one GPU."""
    mode = _optional(nv, "nvmlDeviceGetMigMode", handle)
    if mode is None:
        return agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED, []
    current = mode[0] if isinstance(mode, (list, tuple)) else mode
    if current != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
        return agent_pb2.GpuInfo.MIG_MODE_DISABLED, []
    from .mig_manager import MigError, NvmlMigBackend

    try:
        backend = NvmlMigBackend({index: (name, memory_mib)}, nvml=nv)
        backend._ready = True  # NVML is initialised (and shut down) by discover_topology
        found = backend.list_instances(index)
    except MigError as exc:
        log.warning("mig_instances_unavailable", gpu=index, error=str(exc))
        found = []
    instances = [
        agent_pb2.GpuInfo.MigInstance(profile=m.profile, start=m.start, size=m.size, uuid=m.uuid) for m in found
    ]
    return agent_pb2.GpuInfo.MIG_MODE_ENABLED, instances


def _discover(nv, use_nvidia_smi: bool, sysfs_root: Path = Path("/")) -> agent_pb2.HostTopology:
    count = nv.nvmlDeviceGetCount()
    if count == 0:
        raise DiscoveryError("NVML reports no GPUs on this host")
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_str(nv.nvmlDeviceGetUUID(h)) for h in handles]
    names = [_str(nv.nvmlDeviceGetName(h)) for h in handles]
    memory = [int(nv.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024) for h in handles]
    buses = [normalize_bus_id(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    # The CPU-side NUMA node of each GPU is its PCI device's numa_node in sysfs (nvmlDeviceGetNumaNodeId is the
    # GPU's own memory node on Grace systems, the dump's "GPU NUMA ID", not its affinity).
    gpu_pci = [gpu_pci_device(sysfs_root, b) for b in buses]
    numa = [d.numa for d in gpu_pci]
    index_of_bus = {b: i for i, b in enumerate(buses)}

    # NVLink: links to each peer GPU, and links into NVSwitches.
    direct = [[0] * count for _ in range(count)]
    switch_links = [0] * count
    switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for i, h in enumerate(handles):
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = normalize_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
                    break  # no NVLink on this GPU
                continue  # link absent
            kind = _optional(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            j = index_of_bus.get(remote)
            if j is not None and j != i and kind != switch_type:
                direct[i][j] += 1
            else:
                switch_links[i] += 1

    def gpu_cell(i: int, j: int) -> str:
        links = max(direct[i][j], direct[j][i])
        if links:
            return f"NV{links}"
        if switch_links[i] and switch_links[j]:
            return f"NV{min(switch_links[i], switch_links[j])}"
        level = nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
        return _ANCESTOR_WORDS.get(int(level), "SYS")

    gpus = [f"GPU{i}" for i in range(count)]
    found_nics = sysfs_nics(sysfs_root)
    smi = None
    if found_nics:
        nics = [f"NIC{k}" for k in range(len(found_nics))]
        nic_devices = {n: dev for n, (dev, _) in zip(nics, found_nics, strict=True)}
        pci = {n: d for n, (_, d) in zip(nics, found_nics, strict=True)}
    else:
        smi = _nvidia_smi_dump() if use_nvidia_smi else None
        nics = smi.nics if smi else []
        nic_devices = dict(smi.nic_devices) if smi else {}
        pci = {}
    pci.update({g: d for g, d in zip(gpus, gpu_pci, strict=True)})
    devices = gpus + nics

    def cell(a: str, b: str) -> str:
        if a.startswith("GPU") and b.startswith("GPU"):
            return gpu_cell(int(a[3:]), int(b[3:]))
        if smi is not None:
            return smi.cell(a, b) or "SYS"
        return pci_relation(pci[a], pci[b])

    matrix = {a: {} for a in devices}
    for x, a in enumerate(devices):
        matrix[a][a] = "X"
        for b in devices[x + 1:]:
            matrix[a][b] = matrix.setdefault(b, {})[a] = cell(a, b)
    extras = {}
    for i, g in enumerate(gpus):
        row = dict(smi.extras.get(g, {})) if smi else {}
        if numa[i] >= 0:
            row["NUMA Affinity"] = str(numa[i])
        extras[g] = row
    dump = TopoDump(
        devices=devices,
        matrix={a: {b: matrix[a][b] for b in devices} for a in devices},
        extras=extras,
        extra_columns=["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
        nic_devices=nic_devices,
    )
    cluster, clique = _fabric(nv, handles[0])
    topo = topology_from_dump(
        dump,
        gpu_model=names[0],
        memory_mib=memory[0],
        uuids=uuids,
        pci_bus_ids=buses,
        profile="nvml",
        fabric_cluster_uuid=cluster,
        fabric_clique=clique,
        nic_numa={n: pci[n].numa for n in nics if n in pci},
        nic_pci_bus_ids={n: pci[n].bdf for n in nics if n in pci},
    )
    for i, (g, h) in enumerate(zip(topo.gpus, handles, strict=True)):
        g.name, g.memory_mib, g.numa_node = names[i], memory[i], numa[i]
        cc = _optional(nv, "nvmlDeviceGetCudaComputeCapability", h)
        if cc:
            g.compute_capability = f"{int(cc[0])}.{int(cc[1])}"
        mode, instances = _mig(nv, h, i, names[i], memory[i])
        g.mig_mode = mode
        g.mig_instances.extend(instances)
    return topo


def _fabric(nv, handle) -> tuple[str, str]:
    """The multi-node NVLink fabric (GB200 NVL72) cluster UUID and clique, or ("", "") when none."""
    try:
        info = nv.nvmlDeviceGetGpuFabricInfo(handle)
    except (nv.NVMLError, AttributeError):
        return "", ""
    raw = bytes(getattr(info, "clusterUuid", b"") or b"")
    if not raw.strip(b"\x00"):
        return "", ""
    hexed = raw[:16].hex()
    return f"{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}", str(getattr(info, "cliqueId", ""))
