"""Real GPU discovery through NVML (nvidia-ml-py's `pynvml`).

`discover_topology(node_name)` returns the same proto HostTopology a simulated host gives: GPU count, UUIDs,
model names, memory, PCI bus ids and NUMA nodes from NVML; GPU-to-GPU cells from NVLink state (links to a peer
GPU counted per pair; links into NVSwitches make every pair of switch-attached GPUs NV<links>) and otherwise from
nvmlDeviceGetTopologyCommonAncestor (PIX/PXB/PHB/NODE/SYS). NICs are not visible to NVML: when `nvidia-smi` is on
PATH its `topo -m` table supplies the NIC rows and legend.

Importing this module never needs a GPU; discovery on a host without a driver or GPU raises DiscoveryError with
a message that says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.topo_dump import TopoDump, TopoParseError, matrix_from_pairs, parse_topo

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


def _numa_from_sysfs(bus_id: str) -> int:
    domain, bus, devfn = bus_id.split(":")
    path = Path(f"/sys/bus/pci/devices/{int(domain, 16):04x}:{bus.lower()}:{devfn.lower()}/numa_node")
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


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


def discover_topology(node_name: str = "", use_nvidia_smi: bool = True) -> agent_pb2.HostTopology:
    """Discover this host's GPUs through NVML. Raises DiscoveryError when there is no usable driver or GPU."""
    nv = _load_pynvml()
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise DiscoveryError(
            f"cannot initialise NVML ({exc}): no NVIDIA driver or GPU on this host? "
            "Use --simulate PROFILE or --simulate-from DUMPFILE to run a simulated host."
        ) from exc
    try:
        return _discover(nv, use_nvidia_smi)
    except nv.NVMLError as exc:
        raise DiscoveryError(f"NVML query failed: {exc}") from exc
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def _discover(nv, use_nvidia_smi: bool) -> agent_pb2.HostTopology:
    count = nv.nvmlDeviceGetCount()
    if count == 0:
        raise DiscoveryError("NVML reports no GPUs on this host")
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_str(nv.nvmlDeviceGetUUID(h)) for h in handles]
    names = [_str(nv.nvmlDeviceGetName(h)) for h in handles]
    memory = [int(nv.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024) for h in handles]
    buses = [normalize_bus_id(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    numa: list[int] = []
    for h, bus in zip(handles, buses, strict=True):
        try:
            numa.append(int(nv.nvmlDeviceGetNumaNodeId(h)))
        except (nv.NVMLError, AttributeError):
            numa.append(_numa_from_sysfs(bus))
    index_of_bus = {b: i for i, b in enumerate(buses)}

    # NVLink: links to each peer GPU, and links into NVSwitches.
    direct = [[0] * count for _ in range(count)]
    switch_links = [0] * count
    for i, h in enumerate(handles):
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = normalize_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except nv.NVMLError:
                continue  # link absent or NVLink unsupported on this GPU
            j = index_of_bus.get(remote)
            if j is not None and j != i:
                direct[i][j] += 1
            else:
                switch_links[i] += 1

    def gpu_cell(a: str, b: str) -> str:
        i, j = int(a[3:]), int(b[3:])
        links = max(direct[i][j], direct[j][i])
        if links:
            return f"NV{links}"
        if switch_links[i] and switch_links[j]:
            return f"NV{min(switch_links[i], switch_links[j])}"
        level = nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
        return _ANCESTOR_WORDS.get(int(level), "SYS")

    gpus = [f"GPU{i}" for i in range(count)]
    smi = _nvidia_smi_dump() if use_nvidia_smi else None
    nics = smi.nics if smi else []
    devices = gpus + nics

    def cell(a: str, b: str) -> str:
        if a.startswith("GPU") and b.startswith("GPU"):
            return gpu_cell(a, b)
        return (smi.cell(a, b) if smi else None) or "SYS"

    extras = {}
    for i, g in enumerate(gpus):
        row = dict(smi.extras.get(g, {})) if smi else {}
        if numa[i] >= 0:
            row["NUMA Affinity"] = str(numa[i])
        extras[g] = row
    dump = TopoDump(
        devices=devices,
        matrix=matrix_from_pairs(devices, cell),
        extras=extras,
        extra_columns=["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
        nic_devices=dict(smi.nic_devices) if smi else {},
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
    )
    for g, name, mem in zip(topo.gpus, names, memory, strict=True):
        g.name, g.memory_mib = name, mem
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
