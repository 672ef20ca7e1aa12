"""A fake NVML: the pynvml calls the node agent uses (discovery and MIG), answering as NVML does, fed from a dump.

    from phalanx.core.topo_dump import parse_topo
    from phalanx.testing.fake_nvml import FakeNvml
    from phalanx.testing.fake_sysfs import build_fake_sysfs
    nv = FakeNvml.from_dump(dump, gpu_model="NVIDIA H100 80GB HBM3", memory_mib=81559)
    sysfs = build_fake_sysfs(tmp_path, dump, nv.pci_bus_ids)
    topo = discover_topology(nvml=nv, sysfs_root=tmp_path)

What the fake answers (and how it models the dump):
- nvmlDeviceGetTopologyCommonAncestor: NVML_TOPOLOGY_* enums (INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30,
  NODE 40, SYSTEM 50) from the dump's PCIe words; for an NVLink pair (whose PCIe relation the dump does not show)
  NODE when both GPUs are on the same NUMA node, else SYSTEM.
- NVLink: a GPU whose NV peers add up to more links than a GPU has (an NVSwitch box: HGX/DGX, GB200 tray) has N
  links (N = its largest NV# cell) whose remote PCI info is an NVSwitch (device type SWITCH), not a GPU; a GPU whose
  NV cells fit (hybrid cube mesh NV1/NV2, 4-GPU HGX NV4) has direct links to each peer GPU. On an NVSwitch box a
  GPU with no NV cell (NODE/SYS to every peer) has its links, state disabled. A GPU with no NVLink at all raises
  NVML_ERROR_NOT_SUPPORTED from the NVLink calls; a link past the GPU's links raises NVML_ERROR_INVALID_ARGUMENT.
- nvmlDeviceGetGpuFabricInfo: cluster UUID (16 bytes) and clique id when given, else NVML_ERROR_NOT_SUPPORTED.
- MIG: mode, GPU/compute instance profiles, placements and MIG devices with NVML's placement rules (7 compute
  slices, 8 memory slices), the calls `services.node_agent.mig_manager.NvmlMigBackend` makes.

Errors are pynvml.NVMLError instances (pynvml.NVMLError(code) gives the code's subclass, as the real library raises).
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

from phalanx.core.topo_dump import TopoDump, is_nvlink, nvlink_count

from .fake_sysfs import default_gpu_bus_ids

_NAMESPACE = uuidlib.UUID("0b8c5d1e-6f57-4f0e-9a0b-f4ce0a11e7a1")
# Links one GPU has at most (NVLink4/5: 18). More NV links than this to peers means NVSwitches.
GPU_MAX_LINKS = 18
_ANCESTOR = {"PIX": 10, "PXB": 20, "PHB": 30, "CPU": 30, "NODE": 40, "SYS": 50, "SOC": 50}

# (model substring, compute capability, MIG capable); first match wins.
_MODELS = [
    ("GB200", (10, 0), True), ("B200", (10, 0), True), ("B100", (10, 0), True),
    ("H100", (9, 0), True), ("H200", (9, 0), True), ("H800", (9, 0), True), ("H20", (9, 0), True),
    ("GH200", (9, 0), True), ("A100", (8, 0), True), ("A800", (8, 0), True), ("A30", (8, 0), True),
    ("L40", (8, 9), False), ("L4", (8, 9), False), ("4090", (8, 9), False), ("4080", (8, 9), False),
    ("A10", (8, 6), False), ("A40", (8, 6), False), ("3090", (8, 6), False), ("V100", (7, 0), False),
    ("T4", (7, 5), False),
]

# pynvml GPU instance profile constant -> (profile id, compute slices, memory slices, allowed starts).
GI_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 1, 1, [0, 1, 2, 3, 4, 5, 6]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, 1, 2, [0, 2, 4, 6]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, 2, 2, [0, 2, 4]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, 3, 4, [0, 4]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, 4, 4, [0]),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, 7, 8, [0]),
}


def model_traits(name: str) -> tuple[tuple[int, int], bool]:
    """(compute capability, MIG capable) of a GPU model name; ((0, 0), False) when unknown."""
    for key, cc, mig in _MODELS:
        if key in name:
            return cc, mig
    return (0, 0), False


@dataclass
class FakeGpu:
    index: int
    uuid: str
    name: str
    memory_mib: int
    bus_id: str                                   # "00000000:18:00.0"
    numa: int = -1
    gpu_numa_id: int = -1                         # the GPU's own NUMA node (Grace: "GPU NUMA ID"), -1 when none
    compute_capability: tuple[int, int] = (0, 0)
    mig_capable: bool = False
    mig_mode: list[int] = field(default_factory=lambda: [0, 0])   # [current, pending]
    links: list[tuple[int, str, int]] | None = None  # (state, remote bus id, remote type); None: no NVLink


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """Stands in for the pynvml module. Handles are ("gpu", index) and ("mig", index, gi_id) tuples."""

    NVMLError = pynvml.NVMLError
    c_nvmlGpuInstance_t = ctypes.c_int
    c_nvmlComputeInstance_t = ctypes.c_int
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def __init__(self, gpus: list[FakeGpu], ancestors: dict[tuple[int, int], int] | None = None,
                 fabric: tuple[str, int] | None = None) -> None:
        for name in dir(pynvml):
            if name.startswith("NVML_"):
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.ancestors = dict(ancestors or {})
        self.fabric = fabric
        self.init_error: int | None = None   # set to an NVML_ERROR_* code to make nvmlInit fail
        self.initialised = 0
        self.gis: dict[int, dict] = {}       # gi handle -> {gpu, id, pid, start, size, cis: [(handle, ci pid)]}
        self.calls: list[tuple] = []
        self._next = 1

    # ------------------------------------------------------------------------------------------------ building

    @classmethod
    def from_dump(
        cls,
        dump: TopoDump,
        *,
        gpu_model: str = "NVIDIA H100 80GB HBM3",
        memory_mib: int = 81559,
        uuids: list[str] | None = None,
        pci_bus_ids: list[str] | None = None,
        node_name: str = "fake",
        mig_enabled: bool | list[bool] = False,
        fabric_cluster_uuid: str = "",
        fabric_clique: str | int = "",
    ) -> FakeNvml:
        names = dump.gpus
        n = len(names)
        idx = {g: i for i, g in enumerate(names)}
        buses = list(pci_bus_ids or default_gpu_bus_ids(n))
        uuids = list(uuids or [f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{node_name}/{i}')}" for i in range(n)])
        cc, mig_capable = model_traits(gpu_model)
        migs = mig_enabled if isinstance(mig_enabled, list) else [bool(mig_enabled)] * n
        gpus = []
        for i, g in enumerate(names):
            gpu_numa = dump.gpu_numa_id(g)
            gpus.append(FakeGpu(
                index=int(g[3:]), uuid=uuids[i], name=gpu_model, memory_mib=memory_mib, bus_id=buses[i],
                numa=dump.numa_node(g), gpu_numa_id=int(gpu_numa) if gpu_numa and gpu_numa.isdigit() else -1,
                compute_capability=cc, mig_capable=mig_capable,
                mig_mode=[int(migs[i]), int(migs[i])],
            ))

        # NVLink peers and counts from the dump.
        peers: list[dict[int, int]] = [{} for _ in range(n)]
        for a in names:
            for b in names:
                if a != b:
                    c = dump.cell(a, b)
                    if c is not None and is_nvlink(c):
                        peers[idx[a]][idx[b]] = nvlink_count(c)
        switched = [sum(p.values()) > GPU_MAX_LINKS for p in peers]
        switch_counts = sorted(max(p.values()) for p, s in zip(peers, switched, strict=True) if s)
        typical = switch_counts[len(switch_counts) // 2] if switch_counts else 0
        n_switches = 6 if typical == 12 else 4
        switch_buses = [f"00000000:{0xC1 + k:02X}:00.0" for k in range(n_switches)]
        gpu_type = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        switch_type = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        for i, gpu in enumerate(gpus):
            if switched[i]:
                count = max(peers[i].values())
                gpu.links = [(pynvml.NVML_FEATURE_ENABLED, switch_buses[k % n_switches], switch_type)
                             for k in range(count)]
            elif peers[i]:
                gpu.links = [(pynvml.NVML_FEATURE_ENABLED, buses[j], gpu_type)
                             for j, c in sorted(peers[i].items()) for _ in range(c)][:GPU_MAX_LINKS]
            elif typical:
                # An NVSwitch box, and this GPU reaches no peer over NVLink: its links are down.
                gpu.links = [(pynvml.NVML_FEATURE_DISABLED, switch_buses[k % n_switches], switch_type)
                             for k in range(typical)]

        ancestors: dict[tuple[int, int], int] = {}
        for a in names:
            for b in names:
                if a == b:
                    continue
                c = dump.cell(a, b)
                level = _ANCESTOR.get(c or "")
                if level is None:
                    na, nb = dump.numa_node(a), dump.numa_node(b)
                    level = 40 if na >= 0 and na == nb else 50
                ancestors[(idx[a], idx[b])] = level
        fabric = None
        if fabric_cluster_uuid:
            fabric = (fabric_cluster_uuid, int(fabric_clique or 0))
        return cls(gpus, ancestors, fabric)

    @property
    def pci_bus_ids(self) -> list[str]:
        return [g.bus_id for g in self.gpus]

    # ------------------------------------------------------------------------------------------------ basics

    def _gpu(self, handle) -> FakeGpu:
        if not (isinstance(handle, tuple) and handle and handle[0] == "gpu"):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle[1]]

    def _check(self) -> None:
        if self.initialised <= 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.133.20"

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self._check()
        if not 0 <= index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle) -> str:
        if isinstance(handle, tuple) and handle and handle[0] == "mig":
            return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{self.gpus[handle[1]].uuid}/{handle[2]}')}"
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle):
        total = self._gpu(handle).memory_mib * 1024 * 1024
        return SimpleNamespace(total=total, free=total, used=0)

    @staticmethod
    def _pci(bus_id: str):
        domain, bus, devfn = bus_id.split(":")
        dev, fn = devfn.split(".")
        return SimpleNamespace(busId=bus_id, busIdLegacy=f"{int(domain, 16):04X}:{bus}:{devfn}",
                               domain=int(domain, 16), bus=int(bus, 16), device=int(dev, 16), function=int(fn),
                               pciDeviceId=0, pciSubSystemId=0)

    def nvmlDeviceGetPciInfo(self, handle):
        return self._pci(self._gpu(handle).bus_id)

    def nvmlDeviceGetCudaComputeCapability(self, handle) -> tuple[int, int]:
        cc = tuple(self._gpu(handle).compute_capability)
        if cc == (0, 0):  # a model the fake does not know
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return cc

    def nvmlDeviceGetNumaNodeId(self, handle) -> int:
        gpu = self._gpu(handle)
        if gpu.gpu_numa_id < 0:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.gpu_numa_id

    # ------------------------------------------------------------------------------------------------ topology

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2) -> int:
        a, b = self._gpu(h1), self._gpu(h2)
        if a is b:
            return pynvml.NVML_TOPOLOGY_INTERNAL
        return self.ancestors[(h1[1], h2[1])]

    def _link(self, handle, link: int):
        gpu = self._gpu(handle)
        if gpu.links is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.links):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link]

    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        return self._link(handle, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link: int):
        return self._pci(self._link(handle, link)[1])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link: int) -> int:
        return self._link(handle, link)[2]

    def nvmlDeviceGetGpuFabricInfo(self, handle):
        self._gpu(handle)
        if self.fabric is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        cluster, clique = self.fabric
        return SimpleNamespace(clusterUuid=uuidlib.UUID(cluster).bytes, status=pynvml.NVML_SUCCESS,
                               cliqueId=clique, state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)

    # ------------------------------------------------------------------------------------------------ MIG

    def nvmlDeviceGetMigMode(self, handle) -> list[int]:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.mig_mode)

    def _mig_on(self, handle) -> FakeGpu:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gpu.mig_mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle, profile, version=2):
        gpu = self._mig_on(handle)
        if profile not in GI_PROFILES:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pid, compute, size, _ = GI_PROFILES[profile]
        per_slice = gpu.memory_mib // 8
        return SimpleNamespace(id=pid, sliceCount=compute, instanceCount=7 // compute if size > 1 else 7,
                               memorySizeMB=size * per_slice)

    def _by_pid(self, pid):
        for v in GI_PROFILES.values():
            if v[0] == pid:
                return v
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstances(self, handle, pid, array, count_ref) -> None:
        self._mig_on(handle)
        found = [k for k, g in self.gis.items() if g["gpu"] == handle[1] and g["pid"] == pid]
        for i, k in enumerate(found):
            array[i] = k
        count_ref._obj.value = len(found)

    def nvmlGpuInstanceGetInfo(self, gi):
        if gi not in self.gis:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g = self.gis[gi]
        return SimpleNamespace(id=g["id"], profileId=g["pid"],
                               placement=SimpleNamespace(start=g["start"], size=g["size"]))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle, pid, placement_ref):
        self._mig_on(handle)
        p = placement_ref._obj
        start, size = int(p.start), int(p.size)
        self.calls.append(("create_gi", handle[1], pid, start, size))
        _, _, psize, starts = self._by_pid(pid)
        if size != psize or start not in starts:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mask = ((1 << size) - 1) << start
        for g in self.gis.values():
            if g["gpu"] == handle[1] and (((1 << g["size"]) - 1) << g["start"]) & mask:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {g["id"] for g in self.gis.values() if g["gpu"] == handle[1]}
        gi_id = next(k for k in range(1, 15) if k not in used)
        gi = self._next
        self._next += 1
        self.gis[gi] = {"gpu": handle[1], "id": gi_id, "pid": pid, "start": start, "size": size, "cis": []}
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, profile, eng):
        if eng != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(id=100 + profile, instanceCount=1)

    def nvmlGpuInstanceGetComputeInstances(self, gi, ci_pid, array, count_ref) -> None:
        cis = [c for c, p in self.gis[gi]["cis"] if p == ci_pid]
        for i, c in enumerate(cis):
            array[i] = c
        count_ref._obj.value = len(cis)

    def nvmlGpuInstanceCreateComputeInstance(self, gi, ci_pid):
        self.calls.append(("create_ci", self.gis[gi]["gpu"], self.gis[gi]["id"], ci_pid))
        handle = 1000 + self._next
        self._next += 1
        self.gis[gi]["cis"].append((handle, ci_pid))
        return handle

    def nvmlComputeInstanceDestroy(self, ci) -> None:
        for g in self.gis.values():
            for c in list(g["cis"]):
                if c[0] == ci:
                    g["cis"].remove(c)
                    self.calls.append(("destroy_ci", g["gpu"], g["id"]))
                    return
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceDestroy(self, gi) -> None:
        g = self.gis[gi]
        if g["cis"]:
            raise _err(pynvml.NVML_ERROR_IN_USE)
        self.calls.append(("destroy_gi", g["gpu"], g["id"]))
        del self.gis[gi]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle) -> int:
        return 7 if self._gpu(handle).mig_capable else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index: int):
        devices = sorted(g["id"] for g in self.gis.values() if g["gpu"] == handle[1] and g["cis"])
        if index >= len(devices):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return ("mig", handle[1], devices[index])

    def nvmlDeviceGetGpuInstanceId(self, mig) -> int:
        return mig[2]

    def add_mig_instance(self, gpu: int, profile: int, start: int, ci: bool = True) -> int:
        """A MIG instance made outside the agent (an administrator); profile is a NVML_GPU_INSTANCE_PROFILE_*."""
        pid, compute, size, _ = GI_PROFILES[profile]
        gi = self.nvmlDeviceCreateGpuInstanceWithPlacement(
            ("gpu", gpu), pid, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size)))
        if ci:
            ci_const = getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{compute}_SLICE")
            self.nvmlGpuInstanceCreateComputeInstance(gi, 100 + ci_const)
        self.calls.clear()
        return self.gis[gi]["id"]
