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

Both sources are parameters (`nvml`: the pynvml module, or on a simulated host a private instance of it bound to
phalanx.simhost.nvml's simulated C library; `sysfs_root`: "/" or a tree from phalanx.simhost.sysfs), so the code
that runs on real hosts is the code the tests run, through the real bindings.

Only the core enumeration is fatal: nvmlInit, the device count, the handles, the UUIDs and the PCI info. Anything
else is an optional probe (name, memory, compute capability, NVLink state and remote ends, PCIe ancestry, the GPU
fabric, MIG mode and instances): older drivers, some GPUs and vGPUs answer NVMLError_NotSupported or
NVMLError_FunctionNotFound, or fail in their own ways. Such a failure leaves that fact unknown and logs one warning
per probe (naming the probe, the error and the GPUs); the host still registers.

NVLink fabric domains (GB200 NVL72): a GPU belongs to its fabric's (cluster UUID, clique) only when NVML says its
fabric registration is COMPLETED with status success; any other GPU is outside every domain, with the reason
(`GpuInfo.fabric_reason`). The host is in a domain when all its GPUs are in the same one.

Importing this module never needs a GPU; discovery on a host without a driver or GPU raises DiscoveryError with
a message that says what to check.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.topo_dump import TopoDump, TopoParseError, parse_topo
from phalanx.nvml_h import FABRIC_INFO_V2, nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t

from .topology import topology_from_dump

log = structlog.get_logger()

# nvmlDeviceGetTopologyCommonAncestor levels -> `nvidia-smi topo -m` words.
_ANCESTOR_WORDS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class DiscoveryError(RuntimeError):
    """GPU discovery is impossible here (no driver, no NVML library, no GPU)."""


def normalize_bus_id(bus_id: str | bytes) -> str:
    """ "0000:18:00.0" / "00000000:18:00.0" -> "00000000:18:00.0"."""
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
        ba, bb = a.chain[:-1], b.chain[:-1]  # bridges above each device (root first)
        k = 0
        while k < min(len(ba), len(bb)) and ba[k] == bb[k]:
            k += 1
        # k: common prefix (root, root port, ...). The path turns at ba[k-1].
        if k <= 2:
            return "PHB"  # they meet at the root or the root port: through the host bridge
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
        raise DiscoveryError("nvidia-ml-py (pynvml) is not installed: pip install nvidia-ml-py") from exc
    return pynvml


# ------------------------------------------------------------------------------------------------ probes


@dataclass
class Probes:
    """Optional NVML queries: a failure leaves the fact unknown and is logged once per probe, after discovery."""

    nv: object
    failures: dict[str, dict] = field(default_factory=dict)  # probe -> {"error": str, "gpus": [..]}

    def call(self, probe: str, gpu: int | None, fn_name: str, *args, default=None):
        fn = getattr(self.nv, fn_name, None)
        if fn is None:
            self.failed(probe, gpu, f"nvidia-ml-py has no {fn_name} (an older binding)")
            return default
        try:
            return fn(*args)
        except Exception as exc:  # NVMLError or a binding fault: the fact stays unknown
            self.failed(probe, gpu, _describe(self.nv, exc))
            return default

    def failed(self, probe: str, gpu: int | None, error: str) -> None:
        entry = self.failures.setdefault(probe, {"error": error, "gpus": []})
        if gpu is not None and gpu not in entry["gpus"]:
            entry["gpus"].append(gpu)

    def log(self) -> None:
        for probe, entry in self.failures.items():
            log.warning(
                "nvml_probe_failed",
                probe=probe,
                error=entry["error"],
                gpus=entry["gpus"],
                effect="left unknown; the node registers without it",
            )


def _describe(nv, exc: BaseException) -> str:
    if isinstance(exc, getattr(nv, "NVMLError", ())):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc} (a fault in the NVML binding call)"


def _core(nv, what: str, fn_name: str, *args):
    """A call discovery cannot do without: any failure is a DiscoveryError that says what to check."""
    try:
        return getattr(nv, fn_name)(*args)
    except Exception as exc:  # every failure here ends discovery, with the reason
        raise DiscoveryError(
            f"{what} failed ({_describe(nv, exc)}); check that the NVIDIA driver is loaded (nvidia-smi works), "
            "that this user may open /dev/nvidia*, and that libnvidia-ml.so.1 matches the driver"
        ) from exc


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
    except Exception as exc:  # NVMLError (no driver, no library) or a binding fault
        raise DiscoveryError(
            f"cannot initialise NVML ({_describe(nv, exc)}): is the NVIDIA driver installed and loaded, and is "
            "libnvidia-ml.so.1 on the library path? Use --simulate PROFILE or --simulate-from DUMPFILE to run a "
            "simulated host."
        ) from exc
    probes = Probes(nv)
    try:
        return _discover(nv, use_nvidia_smi, Path(sysfs_root), probes)
    finally:
        probes.log()
        try:
            nv.nvmlShutdown()
        except Exception:  # nothing left to do about it
            pass


def _mig(nv, probes: Probes, handle, index: int, name: str, memory_mib: int):
    """(GpuInfo.MigMode, [GpuInfo.MigInstance]) of one GPU."""
    if not hasattr(nv, "nvmlDeviceGetMigMode"):
        probes.failed("mig_mode", index, "nvidia-ml-py has no nvmlDeviceGetMigMode")
        return agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED, []
    try:
        mode = nv.nvmlDeviceGetMigMode(handle)
    except Exception as exc:  # NotSupported is the normal answer of a GPU without MIG
        if getattr(exc, "value", None) != getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
            probes.failed("mig_mode", index, _describe(nv, exc))
        return agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED, []
    current = mode[0] if isinstance(mode, (list, tuple)) else mode
    if current != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
        return agent_pb2.GpuInfo.MIG_MODE_DISABLED, []
    from .mig_manager import MigError, NvmlMigBackend

    try:
        backend = NvmlMigBackend({index: (name, memory_mib)}, nvml=nv, initialised=True)
        found = backend.list_instances(index)
    except MigError as exc:
        probes.failed("mig_instances", index, str(exc))
        found = []
    instances = [
        agent_pb2.GpuInfo.MigInstance(
            profile=m.profile,
            start=m.start,
            size=m.size,
            uuid=m.uuid,
            gpu_instance_id=m.gi_id,
            compute_instance_id=m.ci_id,
        )
        for m in found
    ]
    return agent_pb2.GpuInfo.MIG_MODE_ENABLED, instances


def _nvlinks(nv, probes: Probes, handles: list, index_of_bus: dict[str, int]):
    """Links to each peer GPU (direct[i][j]) and links into NVSwitches (switch_links[i])."""
    count = len(handles)
    direct = [[0] * count for _ in range(count)]
    switch_links = [0] * count
    switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    not_supported = getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3)
    invalid = getattr(nv, "NVML_ERROR_INVALID_ARGUMENT", 2)
    max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
    for i, h in enumerate(handles):
        for link in range(max_links):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except Exception as exc:  # see below
                code = getattr(exc, "value", None)
                if code == invalid:
                    break  # past this GPU's last link
                if code != not_supported:
                    probes.failed("nvlink_state", i, _describe(nv, exc))
                break  # no NVLink on this GPU (NotSupported), or the probe failed
            remote = probes.call("nvlink_remote_pci_info", i, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            if remote is None:
                continue
            kind = probes.call("nvlink_remote_device_type", i, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            j = index_of_bus.get(normalize_bus_id(remote.busId))
            if j is not None and j != i and kind != switch_type:
                direct[i][j] += 1
            else:
                switch_links[i] += 1
    return direct, switch_links


def _discover(nv, use_nvidia_smi: bool, sysfs_root: Path, probes: Probes) -> agent_pb2.HostTopology:
    count = int(_core(nv, "nvmlDeviceGetCount", "nvmlDeviceGetCount"))
    if count == 0:
        raise DiscoveryError("NVML reports no GPUs on this host (nvidia-smi -L lists them; check the driver)")
    handles = [_core(nv, f"nvmlDeviceGetHandleByIndex({i})", "nvmlDeviceGetHandleByIndex", i) for i in range(count)]
    uuids = [_str(_core(nv, f"nvmlDeviceGetUUID(GPU {i})", "nvmlDeviceGetUUID", h)) for i, h in enumerate(handles)]
    buses = [
        normalize_bus_id(_core(nv, f"nvmlDeviceGetPciInfo(GPU {i})", "nvmlDeviceGetPciInfo", h).busId)
        for i, h in enumerate(handles)
    ]
    names = [_str(probes.call("name", i, "nvmlDeviceGetName", h, default="")) for i, h in enumerate(handles)]
    memory = []
    for i, h in enumerate(handles):
        info = probes.call("memory", i, "nvmlDeviceGetMemoryInfo", h)
        memory.append(int(info.total) // (1024 * 1024) if info is not None else 0)
    # The CPU-side NUMA node of each GPU is its PCI device's numa_node in sysfs (nvmlDeviceGetNumaNodeId is the
    # GPU's own memory node on Grace systems, the dump's "GPU NUMA ID", not its affinity).
    gpu_pci = [gpu_pci_device(sysfs_root, b) for b in buses]
    numa = [d.numa for d in gpu_pci]
    index_of_bus = {b: i for i, b in enumerate(buses)}
    direct, switch_links = _nvlinks(nv, probes, handles, index_of_bus)

    def gpu_cell(i: int, j: int) -> str:
        links = max(direct[i][j], direct[j][i])
        if links:
            return f"NV{links}"
        if switch_links[i] and switch_links[j]:
            return f"NV{min(switch_links[i], switch_links[j])}"
        level = probes.call(
            "topology_common_ancestor", i, "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j]
        )
        if level is None:
            return pci_relation(gpu_pci[i], gpu_pci[j])  # sysfs knows the PCIe path too
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

    matrix: dict[str, dict[str, str]] = {a: {} for a in devices}
    for x, a in enumerate(devices):
        matrix[a][a] = "X"
        for b in devices[x + 1 :]:
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
    fabrics = [gpu_fabric(nv, probes, i, h) for i, h in enumerate(handles)]
    cluster, clique, host_reason = host_fabric(fabrics)
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
    topo.fabric_reason = host_reason
    for i, (g, h) in enumerate(zip(topo.gpus, handles, strict=True)):
        g.name, g.memory_mib, g.numa_node = names[i], memory[i], numa[i]
        cc = probes.call("compute_capability", i, "nvmlDeviceGetCudaComputeCapability", h)
        if cc:
            g.compute_capability = f"{int(cc[0])}.{int(cc[1])}"
        mode, instances = _mig(nv, probes, h, i, names[i], memory[i])
        g.mig_mode = mode
        g.mig_instances.extend(instances)
        g.fabric_cluster_uuid, g.fabric_clique, g.fabric_reason = fabrics[i]
        minor = probes.call("minor_number", i, "nvmlDeviceGetMinorNumber", h)
        if minor is not None:
            g.minor_number = int(minor)
    return topo


# ------------------------------------------------------------------------------------------------ fabric
# The fabric structures are passed in nvml.h's layout (phalanx.nvml_h), not the binding's: nvidia-ml-py 12.x
# declared clusterUuid as char[80] instead of unsigned char[16] in both (13.580 fixed the versioned one, 13.615 the
# first), so its own structures read the library's answer at the wrong offsets. The binding hands the pointer to
# the C function unchanged.

_FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}


def gpu_fabric(nv, probes: Probes, index: int, handle) -> tuple[str, str, str]:
    """(cluster UUID, clique, reason) of one GPU: the domain only when its fabric state is COMPLETED with status
    success; else ("", "", why). ("", "", "") for a GPU that has no fabric at all (NotSupported)."""
    not_supported = getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3)
    info = None
    for fn_name in ("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"):
        fn = getattr(nv, fn_name, None)
        if fn is None:
            continue
        candidate = nvmlGpuFabricInfo_v2_t(version=FABRIC_INFO_V2) if fn_name.endswith("V") else nvmlGpuFabricInfo_t()
        try:
            fn(handle, ctypes.byref(candidate))
        except Exception as exc:  # NotSupported: no fabric; FunctionNotFound: an older driver
            code = getattr(exc, "value", None)
            if code == not_supported:
                return "", "", ""
            if code == getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                continue  # the driver lacks the V call: try the first version
            probes.failed("gpu_fabric_info", index, _describe(nv, exc))
            return "", "", f"fabric info unavailable: {_describe(nv, exc)}"
        info = candidate
        break
    if info is None:
        probes.failed("gpu_fabric_info", index, "neither nvmlDeviceGetGpuFabricInfoV nor nvmlDeviceGetGpuFabricInfo")
        return "", "", "fabric info unavailable: the driver has no fabric call"
    state = _FABRIC_STATES.get(int(info.state), str(int(info.state)))
    if int(info.state) == 0:
        return "", "", ""
    if state != "COMPLETED":
        return "", "", f"fabric registration is {state}, not COMPLETED"
    if int(info.status) != 0:
        err = nv.NVMLError(int(info.status)) if hasattr(nv, "NVMLError") else int(info.status)
        return "", "", f"fabric registration COMPLETED with error status {int(info.status)} ({err})"
    raw = bytes(info.clusterUuid)
    if not raw.strip(b"\x00"):
        return "", "", "fabric registration COMPLETED with an empty cluster UUID"
    hexed = raw.hex()
    cluster = f"{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}"
    return cluster, str(int(info.cliqueId)), ""


def host_fabric(fabrics: list[tuple[str, str, str]]) -> tuple[str, str, str]:
    """The host's (cluster, clique, reason): the domain all its GPUs are in, else none with the reason."""
    domains = {(c, q) for c, q, _ in fabrics}
    reasons = [f"GPU {i}: {r}" for i, (_, _, r) in enumerate(fabrics) if r]
    if reasons:
        return "", "", "; ".join(reasons)
    if len(domains) == 1:
        ((cluster, clique),) = domains
        return cluster, clique, ""
    return (
        "",
        "",
        "the GPUs of this host are in different fabric domains: "
        + ", ".join(sorted(f"{c}/{q}" if c else "none" for c, q in domains)),
    )
