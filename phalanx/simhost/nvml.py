"""A simulated NVML C library under the real nvidia-ml-py bindings.

`bind(host)` returns a private instance of the installed `pynvml` module (the real binding code, loaded afresh so
its globals are its own) whose library is a `SimulatedNvmlLibrary` instead of `libnvidia-ml.so.1`. Only two things
are replaced: the library loading (`pynvml.nvmlLib` is set before the first call, so `_LoadNvmlLibrary` never opens
the shared object) and the function-pointer lookup (the binding's own `getattr(nvmlLib, name)` finds ctypes
function pointers here). Every call therefore goes through the binding's real code: its argument marshalling, its
ctypes structures and its return-code checks. A binding called with the wrong arity fails in the binding; a binding
whose structure disagrees with nvml.h reads what the C library wrote at nvml.h's offsets, as on a real host.

    host = SimulatedHost.from_dump(dump, gpu_model="NVIDIA H100 80GB HBM3", memory_mib=81559, node_name="n1")
    nv = bind(host)
    nv.nvmlInit(); nv.nvmlDeviceGetCount()   # -> 8, answered by SimulatedHost

What the C functions implement (nvml.h signatures; pointers arrive as addresses and are filled at nvml.h's layout,
the structures below):
- init/shutdown (reference counted; every device call before init is NVML_ERROR_UNINITIALIZED), error strings,
  driver, NVML and CUDA versions;
- device enumeration: count, handles by index, UUID, name, memory (v1 and v2 structs), PCI info (v3), compute
  capability, NUMA node id (Grace GPUs only), common ancestor (NVML_TOPOLOGY_* from the dump's PCIe words; NODE or
  SYSTEM for an NVLink pair by NUMA node);
- NVLink: per-link state, remote PCI info (v2) and remote device type. A GPU whose NV peers add up to more links
  than one GPU has (an NVSwitch baseboard, a GB200 tray) has N links into NVSwitches (N: its largest NV# cell); a
  GPU whose NV cells fit (hybrid cube mesh, NV4 pairs) has direct links to each peer; on an NVSwitch box a GPU with
  no NV cell has its links disabled; a GPU without NVLink answers NVML_ERROR_NOT_SUPPORTED;
- the GPU fabric (multi-node NVLink, GB200 NVL72): `nvmlDeviceGetGpuFabricInfo` (v1 struct) and
  `nvmlDeviceGetGpuFabricInfoV` (v2/v3, version checked as NVML does: NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
- MIG: mode (get/set; disabling with instances is NVML_ERROR_IN_USE), GPU instance profiles (v1 and V structs,
  from phalanx.core.mig's tables with their NVML profile ids), possible placements, creation with and without a
  placement (NVIDIA's placement rules, compute-slice budget, one media-extension instance per GPU), compute
  instance profiles and instances, MIG device handles and their ids and UUIDs, destruction (a GPU instance with
  compute instances is NVML_ERROR_IN_USE). The MIG state can live in a file, so it survives an agent restart the
  way a real GPU's instances do;
- health: event sets with XID critical errors (`inject_xid`), volatile and aggregate ECC counters, clocks event
  (throttle) reasons.

Failure injection for tests: `host.fail[c_name] = NVML_ERROR_*` makes that C function return the code;
`host.missing.add(c_name)` removes it from the library (the binding then raises NVMLError_FunctionNotFound, as
with an older driver). Any exception inside a C function is recorded in `host.errors` and answered
NVML_ERROR_UNKNOWN (a C library cannot raise), so tests can assert it stays empty.
"""

from __future__ import annotations

import ctypes as C
import importlib.util
import itertools
import json
import os
import sys
import threading
import uuid as uuidlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.core import mig as migcore
from phalanx.core.topo_dump import TopoDump, is_nvlink, nvlink_count
from phalanx.nvml_h import (  # nvml.h's layouts, shared with the agent's discovery
    CI_PROFILE_INFO_V2,
    FABRIC_INFO_V2,
    FABRIC_INFO_V3,
    GI_PROFILE_INFO_V2,
    MEMORY_V2,
    nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t,
    nvmlEventData_t,
    nvmlGpuFabricInfo_t,
    nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t,
    nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t,
    nvmlMemory_t,
    nvmlMemory_v2_t,
    nvmlPciInfo_t,
)

from .sysfs import default_gpu_bus_ids

# ------------------------------------------------------------------------------------------------ nvml.h constants

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED = 0, 1
NVML_NVLINK_DEVICE_TYPE_GPU, NVML_NVLINK_DEVICE_TYPE_IBMNPU, NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 1, 2
NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_NODE, NVML_TOPOLOGY_SYSTEM = 0, 40, 50
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, NVML_GPU_FABRIC_STATE_NOT_STARTED = 0, 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_GPU_FABRIC_STATE_COMPLETED = 2, 3
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
MAX_LINKS_PER_GPU = 18  # NVLink4/5 links of one GPU; more NV links than this to peers means NVSwitches

_ERROR_STRINGS = {
    0: b"Success",
    1: b"Uninitialized",
    2: b"Invalid Argument",
    3: b"Not Supported",
    4: b"Insufficient Permissions",
    6: b"Not Found",
    7: b"Insufficient Size",
    9: b"Driver Not Loaded",
    10: b"Timeout",
    12: b"NVML Shared Library Not Found",
    13: b"Function Not Found",
    15: b"GPU is lost",
    16: b"GPU requires restart",
    19: b"In use by another client",
    23: b"Insufficient resources",
    25: b"Argument version mismatch",
    999: b"Unknown Error",
}
_ERROR_BUFFERS = {code: C.create_string_buffer(text) for code, text in _ERROR_STRINGS.items()}


# ------------------------------------------------------------------------------------------------ the simulated host

# (model substring, compute capability, MIG capable); first match wins.
_MODELS = [
    ("GB200", (10, 0), True),
    ("B200", (10, 0), True),
    ("B100", (10, 0), True),
    ("GH200", (9, 0), True),
    ("H100", (9, 0), True),
    ("H200", (9, 0), True),
    ("H800", (9, 0), True),
    ("H20", (9, 0), True),
    ("A100", (8, 0), True),
    ("A800", (8, 0), True),
    ("A30", (8, 0), True),
    ("L40", (8, 9), False),
    ("L4", (8, 9), False),
    ("4090", (8, 9), False),
    ("4080", (8, 9), False),
    ("A10", (8, 6), False),
    ("A40", (8, 6), False),
    ("3090", (8, 6), False),
    ("V100", (7, 0), False),
    ("T4", (7, 5), False),
]
_ANCESTOR = {"PIX": 10, "PXB": 20, "PHB": 30, "CPU": 30, "NODE": 40, "SYS": 50, "SOC": 50}
_NAMESPACE = uuidlib.UUID("0b8c5d1e-6f57-4f0e-9a0b-f4ce0a11e7a1")


def model_traits(name: str) -> tuple[tuple[int, int], bool]:
    """(compute capability, MIG capable) of a GPU model name; ((0, 0), False) when unknown."""
    for key, cc, mig in _MODELS:
        if key in name:
            return cc, mig
    return (0, 0), False


@dataclass
class SimComputeInstance:
    id: int
    profile_id: int
    slices: int


@dataclass
class SimGpuInstance:
    id: int
    profile_id: int
    start: int
    size: int
    compute: int
    media: bool = False
    cis: list[SimComputeInstance] = field(default_factory=list)


@dataclass
class SimGpu:
    index: int
    uuid: str
    name: str
    memory_mib: int
    bus_id: str  # "00000000:18:00.0"
    numa: int = -1
    gpu_numa_id: int = -1  # the GPU's own NUMA node (Grace), -1 when none
    compute_capability: tuple[int, int] = (0, 0)
    mig_capable: bool = False
    mig_mode: list[int] = field(default_factory=lambda: [0, 0])  # [current, pending]
    links: list[tuple[int, str, int]] | None = None  # (state, remote bus id, remote device type); None: no NVLink
    gis: list[SimGpuInstance] = field(default_factory=list)
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    clocks_event_reasons: int = 0
    lost: bool = False

    @property
    def family(self) -> str | None:
        return migcore.mig_family(self.name, self.memory_mib) if self.mig_capable else None


@dataclass
class SimFabric:
    cluster_uuid: str
    clique: int
    state: int = NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = NVML_SUCCESS


class SimulatedHost:
    """The hardware a simulated NVML library answers for: GPUs, their links and PCIe ancestry, the fabric, MIG."""

    def __init__(
        self,
        gpus: list[SimGpu],
        ancestors: dict[tuple[int, int], int] | None = None,
        fabric: SimFabric | None = None,
        *,
        driver_version: str = "570.133.20",
        cuda_version: int = 12080,
        state_file: str | Path | None = None,
    ) -> None:
        self.gpus = gpus
        self.ancestors = dict(ancestors or {})
        self.fabric = fabric
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.state_file = Path(state_file) if state_file else None
        self.fail: dict[str, int] = {}  # C function -> NVML_ERROR_* it returns
        self.missing: set[str] = set()  # C functions the library lacks (older driver)
        self.init_error: int | None = None  # what nvmlInitWithFlags returns (e.g. NVML_ERROR_DRIVER_NOT_LOADED)
        self.mig_reset_required = False  # a MIG mode switch stays pending until reset_gpu (a VM)
        self.errors: list[str] = []  # exceptions raised inside C functions (bugs in the simulation)
        self.calls: list[tuple] = []  # MIG mutations, for tests
        self._lock = threading.RLock()
        self._events: deque[tuple[int, int, int]] = deque()  # (gpu, event type, data)
        self._event_cond = threading.Condition(self._lock)
        self._load()

    # ---------------------------------------------------------------- building

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
        mig_enabled: bool | list[bool] | set[int] = False,
        fabric_cluster_uuid: str = "",
        fabric_clique: str | int = "",
        fabric_state: int = NVML_GPU_FABRIC_STATE_COMPLETED,
        fabric_status: int = NVML_SUCCESS,
        state_file: str | Path | None = None,
    ) -> SimulatedHost:
        names = dump.gpus
        n = len(names)
        idx = {g: i for i, g in enumerate(names)}
        buses = list(pci_bus_ids or default_gpu_bus_ids(n))
        uuids = list(uuids or [f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{node_name}/{i}')}" for i in range(n)])
        cc, mig_capable = model_traits(gpu_model)
        if isinstance(mig_enabled, (set, frozenset)):
            migs = [i in mig_enabled for i in range(n)]
        elif isinstance(mig_enabled, list):
            migs = [bool(m) for m in mig_enabled]
        else:
            migs = [bool(mig_enabled)] * n
        gpus = []
        for i, g in enumerate(names):
            gpu_numa = dump.gpu_numa_id(g)
            on = int(migs[i] and mig_capable)
            gpus.append(
                SimGpu(
                    index=int(g[3:]),
                    uuid=uuids[i],
                    name=gpu_model,
                    memory_mib=memory_mib,
                    bus_id=buses[i],
                    numa=dump.numa_node(g),
                    gpu_numa_id=int(gpu_numa) if gpu_numa and gpu_numa.isdigit() else -1,
                    compute_capability=cc,
                    mig_capable=mig_capable,
                    mig_mode=[on, on],
                )
            )
        _links_from_dump(dump, gpus, idx, buses)
        ancestors: dict[tuple[int, int], int] = {}
        for a in names:
            for b in names:
                if a == b:
                    continue
                level = _ANCESTOR.get(dump.cell(a, b) or "")
                if level is None:  # an NVLink pair: the dump does not show its PCIe relation
                    na, nb = dump.numa_node(a), dump.numa_node(b)
                    level = NVML_TOPOLOGY_NODE if na >= 0 and na == nb else NVML_TOPOLOGY_SYSTEM
                ancestors[(idx[a], idx[b])] = level
        fabric = None
        if fabric_cluster_uuid:
            fabric = SimFabric(fabric_cluster_uuid, int(fabric_clique or 0), fabric_state, fabric_status)
        return cls(gpus, ancestors, fabric, state_file=state_file)

    @property
    def pci_bus_ids(self) -> list[str]:
        return [g.bus_id for g in self.gpus]

    # ---------------------------------------------------------------- persistence (MIG state and mode)

    def _load(self) -> None:
        if not self.state_file or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
            for gpu in self.gpus:
                saved = data.get("gpus", {}).get(str(gpu.index))
                if not saved or not gpu.mig_capable:
                    continue
                gpu.mig_mode = [int(m) for m in saved.get("mig_mode", gpu.mig_mode)]
                gpu.gis = [
                    SimGpuInstance(**{**g, "cis": [SimComputeInstance(**c) for c in g.get("cis", [])]})
                    for g in saved.get("gis", [])
                ]
        except (OSError, ValueError, TypeError) as exc:
            self.errors.append(f"unreadable simulated GPU state {self.state_file}: {exc}")

    def save(self) -> None:
        if not self.state_file:
            return
        data = {
            "gpus": {
                str(g.index): {
                    "mig_mode": g.mig_mode,
                    "gis": [
                        {
                            "id": gi.id,
                            "profile_id": gi.profile_id,
                            "start": gi.start,
                            "size": gi.size,
                            "compute": gi.compute,
                            "media": gi.media,
                            "cis": [{"id": c.id, "profile_id": c.profile_id, "slices": c.slices} for c in gi.cis],
                        }
                        for gi in g.gis
                    ],
                }
                for g in self.gpus
                if g.mig_capable
            }
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.state_file)

    # ---------------------------------------------------------------- what tests and operators do to the host

    def add_mig_instance(self, gpu: int, profile: str, start: int, ci: bool = True) -> int:
        """A MIG instance made outside the agent (an administrator with nvidia-smi); returns its GPU instance id."""
        g = self.gpus[gpu]
        prof = migcore.resolve(profile, g.family)
        if prof is None:
            raise ValueError(f"GPU {gpu} has no MIG profile {profile}")
        with self._lock:
            gi = self._create_gi(g, prof, start)
            if isinstance(gi, int):
                raise ValueError(f"cannot create {profile} at {start} on GPU {gpu}: {_ERROR_STRINGS.get(gi)}")
            if ci:
                gi.cis.append(SimComputeInstance(0, prof.nvml_ci_value, gi.compute))
            self.save()
            return gi.id

    def reset_gpu(self, gpu: int) -> None:
        """`nvidia-smi -r`: a pending MIG mode applies."""
        with self._lock:
            g = self.gpus[gpu]
            g.mig_mode = [g.mig_mode[1], g.mig_mode[1]]
            self.save()

    def inject_xid(self, gpu: int, xid: int) -> None:
        with self._event_cond:
            self._events.append((gpu, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, xid))
            self._event_cond.notify_all()

    def mig_device_uuid(self, gpu: int, gi_id: int, ci_id: int) -> str:
        return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{self.gpus[gpu].uuid}/{gi_id}/{ci_id}')}"

    # ---------------------------------------------------------------- MIG rules

    def _profile_by_id(self, gpu: SimGpu, profile_id: int) -> migcore.MigProfile | None:
        return migcore.profile_by_id(gpu.family, profile_id)

    def _create_gi(self, gpu: SimGpu, prof: migcore.MigProfile, start: int | None) -> SimGpuInstance | int:
        compute_total, memory_total = migcore.family_slices(gpu.family)
        media = prof.media
        starts = [s for s in prof.starts if s + prof.size <= memory_total]
        used = 0
        for gi in gpu.gis:
            used |= ((1 << gi.size) - 1) << gi.start
        candidates = starts if start is None else [start]
        if start is not None and start not in starts:
            return NVML_ERROR_INVALID_ARGUMENT
        free = [s for s in candidates if not used & (((1 << prof.size) - 1) << s)]
        if not free:
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        if sum(gi.compute for gi in gpu.gis) + prof.compute > compute_total:
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        if media and any(gi.media for gi in gpu.gis):
            return NVML_ERROR_INSUFFICIENT_RESOURCES  # one set of media engines per GPU
        if sum(1 for gi in gpu.gis if gi.profile_id == prof.profile_id) >= _max_count(prof, gpu.family):
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        ids = {gi.id for gi in gpu.gis}
        gi = SimGpuInstance(
            id=next(i for i in itertools.count(1) if i not in ids),
            profile_id=prof.profile_id,
            start=free[0],
            size=prof.size,
            compute=prof.compute,
            media=media,
        )
        gpu.gis.append(gi)
        return gi


def _links_from_dump(dump: TopoDump, gpus: list[SimGpu], idx: dict[str, int], buses: list[str]) -> None:
    names = dump.gpus
    n = len(names)
    peers: list[dict[int, int]] = [{} for _ in range(n)]
    for a in names:
        for b in names:
            if a != b:
                c = dump.cell(a, b)
                if c is not None and is_nvlink(c):
                    peers[idx[a]][idx[b]] = nvlink_count(c)
    switched = [sum(p.values()) > MAX_LINKS_PER_GPU for p in peers]
    switch_counts = sorted(max(p.values()) for p, s in zip(peers, switched, strict=True) if s)
    typical = switch_counts[len(switch_counts) // 2] if switch_counts else 0
    n_switches = 6 if typical == 12 else 4
    switch_buses = [f"00000000:{0xC1 + k:02X}:00.0" for k in range(n_switches)]
    for i, gpu in enumerate(gpus):
        if switched[i]:
            gpu.links = [
                (NVML_FEATURE_ENABLED, switch_buses[k % n_switches], NVML_NVLINK_DEVICE_TYPE_SWITCH)
                for k in range(max(peers[i].values()))
            ]
        elif peers[i]:
            gpu.links = [
                (NVML_FEATURE_ENABLED, buses[j], NVML_NVLINK_DEVICE_TYPE_GPU)
                for j, c in sorted(peers[i].items())
                for _ in range(c)
            ][:MAX_LINKS_PER_GPU]
        elif typical:  # an NVSwitch box, and this GPU reaches no peer over NVLink: its links are down
            gpu.links = [
                (NVML_FEATURE_DISABLED, switch_buses[k % n_switches], NVML_NVLINK_DEVICE_TYPE_SWITCH)
                for k in range(typical)
            ]


def _max_count(prof: migcore.MigProfile, family: str | None) -> int:
    return prof.max_count or min(migcore.family_slices(family)[0] // prof.compute, len(prof.starts))


# nvml.h's compute instance profile enum (NVML_COMPUTE_INSTANCE_PROFILE_*) -> compute slices.
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6, 7: 1}


# ------------------------------------------------------------------------------------------------ the C library


def _c_function(*argtypes):
    """Mark a method as the C function of that name with these nvml.h parameter types (returns nvmlReturn_t)."""

    def mark(fn):
        fn.c_argtypes = argtypes
        return fn

    return mark


def _integer(base: type) -> type:
    """A parameter type that takes what a C compiler would pass for an integer or enum parameter: a Python int or
    any ctypes integer (pynvml passes c_uint for nvml.h's enums, ints elsewhere), nothing else."""

    class Integer(base):  # type: ignore[misc, valid-type]
        @classmethod
        def from_param(cls, obj):
            value = obj.value if isinstance(obj, C._SimpleCData) else obj
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"expected an integer for a {base.__name__} parameter, got {type(obj).__name__}")
            return base(value)

    Integer.__name__ = base.__name__
    return Integer


P = C.c_void_p  # any pointer or opaque handle
U = _integer(C.c_uint)  # unsigned int, and nvml.h's enums
ULL = _integer(C.c_ulonglong)


def _prototype(argtypes: tuple, restype=C.c_int) -> type:
    # _flags_ 0 rather than CFUNCTYPE's cdecl flag: on Linux the calling convention is the same, and ctypes then
    # refuses a call with the wrong number of arguments instead of passing extras a C function would never read.
    return type("NvmlCFunction", (C._CFuncPtr,), {"_argtypes_": argtypes, "_restype_": restype, "_flags_": 0})


class SimulatedNvmlLibrary:
    """What `CDLL("libnvidia-ml.so.1")` would be: attribute lookup gives ctypes function pointers, each a C entry
    point (nvml.h's parameter types, nvmlReturn_t result) into `NvmlFunctions`."""

    def __init__(self, host: SimulatedHost) -> None:
        self._host = host
        self._impl = NvmlFunctions(host)
        self._functions: dict[str, Any] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        functions = self.__dict__["_functions"]
        if name in functions:
            return functions[name]
        host = self._host
        impl = getattr(NvmlFunctions, name, None)
        if impl is None or not hasattr(impl, "c_argtypes") or name in host.missing:
            raise AttributeError(f"undefined symbol: {name}")
        restype = C.c_void_p if name == "nvmlErrorString" else C.c_int
        bound = getattr(self._impl, name)

        def c_entry(*args, _name=name, _impl=bound):
            if _name in host.fail:
                return host.fail[_name]
            args = tuple(a.value if isinstance(a, C._SimpleCData) else a for a in args)
            try:
                with host._lock:
                    result = _impl(*args)
                return NVML_SUCCESS if result is None else result
            except Exception as exc:  # a C function cannot raise: record the bug and answer as NVML would
                host.errors.append(f"{_name}: {type(exc).__name__}: {exc}")
                return NVML_ERROR_UNKNOWN

        fn = _prototype(impl.c_argtypes, restype)(c_entry)
        functions[name] = fn
        return fn


class NvmlFunctions:
    """The C functions of the simulated library, over one SimulatedHost."""

    def __init__(self, host: SimulatedHost) -> None:
        self._host = host
        self._refcount = 0
        self._handles: dict[int, tuple] = {}  # address -> ("gpu", i) | ("mig", i, gi, ci) | ("gi", i, gi) | ...
        self._cells: dict[tuple, Any] = {}  # the objects whose addresses are the handles
        self._error_strings = _ERROR_BUFFERS

    # ---------------------------------------------------------------- plumbing

    def _handle(self, key: tuple) -> int:
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = C.c_ulonglong(len(self._cells) + 1)
            self._handles[C.addressof(cell)] = key
        return C.addressof(cell)

    def _key(self, handle: int | None) -> tuple | None:
        return self._handles.get(handle or 0)

    def _ready(self) -> int:
        return NVML_SUCCESS if self._refcount > 0 else NVML_ERROR_UNINITIALIZED

    def _device(self, handle) -> tuple[SimGpu | None, int]:
        """(the physical GPU of a device handle, NVML_SUCCESS) or (None, error)."""
        if self._refcount <= 0:
            return None, NVML_ERROR_UNINITIALIZED
        key = self._key(handle)
        if key is None or key[0] != "gpu":
            return None, NVML_ERROR_INVALID_ARGUMENT
        gpu = self._host.gpus[key[1]]
        if gpu.lost:
            return None, NVML_ERROR_GPU_IS_LOST
        return gpu, NVML_SUCCESS

    @staticmethod
    def _put(ptr, ctype, value) -> int:
        if not ptr:
            return NVML_ERROR_INVALID_ARGUMENT
        ctype.from_address(ptr).value = value
        return NVML_SUCCESS

    @staticmethod
    def _put_string(buf, length: int, text: str) -> int:
        if not buf:
            return NVML_ERROR_INVALID_ARGUMENT
        data = text.encode() + b"\0"
        if len(data) > length:
            return NVML_ERROR_INSUFFICIENT_SIZE
        C.memmove(buf, data, len(data))
        return NVML_SUCCESS

    @staticmethod
    def _struct(ptr, struct: type[C.Structure]):
        return struct.from_address(ptr) if ptr else None

    # ---------------------------------------------------------------- init and system

    @_c_function(U)
    def nvmlInitWithFlags(self, flags):
        if self._host.init_error is not None:
            return self._host.init_error
        self._refcount += 1

    @_c_function()
    def nvmlShutdown(self):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        self._refcount -= 1

    @_c_function(U)
    def nvmlErrorString(self, result):
        return C.addressof(self._error_strings.get(result, self._error_strings[NVML_ERROR_UNKNOWN]))

    @_c_function(P, U)
    def nvmlSystemGetDriverVersion(self, buf, length):
        return self._ready() or self._put_string(buf, length, self._host.driver_version)

    @_c_function(P, U)
    def nvmlSystemGetNVMLVersion(self, buf, length):
        return self._ready() or self._put_string(buf, length, f"12.{self._host.driver_version}")

    @_c_function(P)
    def nvmlSystemGetCudaDriverVersion(self, out):
        return self._ready() or self._put(out, C.c_int, self._host.cuda_version)

    @_c_function(P)
    def nvmlSystemGetCudaDriverVersion_v2(self, out):
        return self._ready() or self._put(out, C.c_int, self._host.cuda_version)

    # ---------------------------------------------------------------- devices

    @_c_function(P)
    def nvmlDeviceGetCount_v2(self, out):
        return self._ready() or self._put(out, C.c_uint, len(self._host.gpus))

    @_c_function(U, P)
    def nvmlDeviceGetHandleByIndex_v2(self, index, out):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        if not 0 <= index < len(self._host.gpus):
            return NVML_ERROR_INVALID_ARGUMENT
        return self._put(out, C.c_void_p, self._handle(("gpu", index)))

    @_c_function(P, P, U)
    def nvmlDeviceGetUUID(self, handle, buf, length):
        key = self._key(handle)
        if key is not None and key[0] == "mig" and self._refcount > 0:
            return self._put_string(buf, length, self._host.mig_device_uuid(key[1], key[2], key[3]))
        gpu, err = self._device(handle)
        return err or self._put_string(buf, length, gpu.uuid)

    @_c_function(P, P, U)
    def nvmlDeviceGetName(self, handle, buf, length):
        gpu, err = self._device(handle)
        return err or self._put_string(buf, length, gpu.name)

    @_c_function(P, P)
    def nvmlDeviceGetMemoryInfo(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        mem = self._struct(out, nvmlMemory_t)
        mem.total = gpu.memory_mib * 1024 * 1024
        mem.free, mem.used = mem.total, 0

    @_c_function(P, P)
    def nvmlDeviceGetMemoryInfo_v2(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        mem = self._struct(out, nvmlMemory_v2_t)
        if mem.version != MEMORY_V2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        mem.total = gpu.memory_mib * 1024 * 1024
        mem.reserved = 0
        mem.free, mem.used = mem.total, 0

    @staticmethod
    def _fill_pci(out, bus_id: str) -> int:
        if not out:
            return NVML_ERROR_INVALID_ARGUMENT
        domain, bus, devfn = bus_id.split(":")
        dev, fn = devfn.split(".")
        pci = nvmlPciInfo_t.from_address(out)
        pci.busId = bus_id.encode()
        pci.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{devfn}".encode()
        pci.domain, pci.bus, pci.device = int(domain, 16), int(bus, 16), int(dev, 16)
        pci.pciDeviceId, pci.pciSubSystemId = 0x233010DE, 0x16C110DE
        del fn
        return NVML_SUCCESS

    @_c_function(P, P)
    def nvmlDeviceGetPciInfo_v3(self, handle, out):
        gpu, err = self._device(handle)
        return err or self._fill_pci(out, gpu.bus_id)

    @_c_function(P, P)
    def nvmlDeviceGetMinorNumber(self, handle, out):
        gpu, err = self._device(handle)
        if err:
            return err
        return self._put(out, C.c_uint, gpu.index)  # /dev/nvidia<index>, as on hosts whose GPUs enumerate in order

    @_c_function(P, P, P)
    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        gpu, err = self._device(handle)
        if err:
            return err
        if gpu.compute_capability == (0, 0):
            return NVML_ERROR_NOT_SUPPORTED
        return self._put(major, C.c_int, gpu.compute_capability[0]) or self._put(
            minor, C.c_int, gpu.compute_capability[1]
        )

    @_c_function(P, P)
    def nvmlDeviceGetNumaNodeId(self, handle, out):
        gpu, err = self._device(handle)
        if err:
            return err
        if gpu.gpu_numa_id < 0:
            return NVML_ERROR_NOT_SUPPORTED
        return self._put(out, C.c_uint, gpu.gpu_numa_id)

    @_c_function(P, P, P)
    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2, out):
        a, err = self._device(h1)
        b, err2 = self._device(h2)
        if err or err2:
            return err or err2
        level = (
            NVML_TOPOLOGY_INTERNAL
            if a is b
            else self._host.ancestors[(self._host.gpus.index(a), self._host.gpus.index(b))]
        )
        return self._put(out, C.c_int, level)

    # ---------------------------------------------------------------- NVLink

    def _link(self, handle, link):
        gpu, err = self._device(handle)
        if err:
            return None, err
        if gpu.links is None:
            return None, NVML_ERROR_NOT_SUPPORTED
        if not 0 <= link < len(gpu.links):
            return None, NVML_ERROR_INVALID_ARGUMENT
        return gpu.links[link], NVML_SUCCESS

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkState(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._put(out, C.c_int, info[0])

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._fill_pci(out, info[1])

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._put(out, C.c_int, info[2])

    # ---------------------------------------------------------------- fabric

    def _fill_fabric(self, info, fabric: SimFabric) -> None:
        info.clusterUuid[:] = list(uuidlib.UUID(fabric.cluster_uuid).bytes)
        info.status, info.cliqueId, info.state = fabric.status, fabric.clique, fabric.state

    @_c_function(P, P)
    def nvmlDeviceGetGpuFabricInfo(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        if self._host.fabric is None:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_fabric(self._struct(out, nvmlGpuFabricInfo_t), self._host.fabric)

    @_c_function(P, P)
    def nvmlDeviceGetGpuFabricInfoV(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        version = C.c_uint.from_address(out).value
        if version not in (FABRIC_INFO_V2, FABRIC_INFO_V3):
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if self._host.fabric is None:
            return NVML_ERROR_NOT_SUPPORTED
        struct = nvmlGpuFabricInfo_v3_t if version == FABRIC_INFO_V3 else nvmlGpuFabricInfo_v2_t
        info = self._struct(out, struct)
        self._fill_fabric(info, self._host.fabric)
        info.healthMask = 0

    # ---------------------------------------------------------------- MIG

    def _mig_gpu(self, handle) -> tuple[SimGpu | None, int]:
        gpu, err = self._device(handle)
        if err:
            return None, err
        if not gpu.mig_capable or gpu.family is None:
            return None, NVML_ERROR_NOT_SUPPORTED
        return gpu, NVML_SUCCESS

    @_c_function(P, P, P)
    def nvmlDeviceGetMigMode(self, handle, current, pending):
        gpu, err = self._mig_gpu(handle)
        return err or self._put(current, C.c_uint, gpu.mig_mode[0]) or self._put(pending, C.c_uint, gpu.mig_mode[1])

    @_c_function(P, U, P)
    def nvmlDeviceSetMigMode(self, handle, mode, activation):
        gpu, err = self._mig_gpu(handle)
        if err:
            return err
        if mode not in (0, 1):
            return NVML_ERROR_INVALID_ARGUMENT
        if mode == 0 and gpu.gis:
            return NVML_ERROR_IN_USE
        self._host.calls.append(("set_mig_mode", gpu.index, int(mode)))
        if self._host.mig_reset_required:  # pass-through VMs: NVML cannot reset the GPU itself
            gpu.mig_mode[1] = int(mode)
            self._host.save()
            return self._put(activation, C.c_int, NVML_ERROR_RESET_REQUIRED)
        gpu.mig_mode = [int(mode), int(mode)]  # bare metal: NVML resets the idle GPU and the mode applies
        self._host.save()
        return self._put(activation, C.c_int, NVML_SUCCESS)

    def _mig_on(self, handle) -> tuple[SimGpu | None, int]:
        gpu, err = self._mig_gpu(handle)
        if err:
            return None, err
        if gpu.mig_mode[0] != 1:
            return None, NVML_ERROR_INVALID_ARGUMENT
        return gpu, NVML_SUCCESS

    def _gi_profile(self, gpu: SimGpu, profile_enum: int) -> migcore.MigProfile | None:
        return migcore.profile_for_nvml(gpu.family, profile_enum)

    def _fill_gi_profile(self, info, gpu: SimGpu, prof: migcore.MigProfile) -> None:
        compute_total, _ = migcore.family_slices(gpu.family)
        info.id = prof.profile_id
        info.isP2pSupported = 0
        info.sliceCount = prof.compute
        info.instanceCount = _max_count(prof, gpu.family)
        info.multiprocessorCount = prof.compute * 16
        info.copyEngineCount = max(1, prof.compute)
        info.decoderCount = prof.compute if prof.compute > 1 or prof.media else 0
        info.encoderCount = 0
        info.jpegCount = int(prof.compute == compute_total or prof.media)
        info.ofaCount = int(prof.compute == compute_total or prof.media)
        info.memorySizeMB = prof.memory_gb * 1024 if prof.memory_gb else 0
        if hasattr(info, "name"):
            info.name = f"MIG {prof.name}".encode()

    @_c_function(P, U, P)
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle, profile, out):
        gpu, err = self._mig_gpu(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        prof = self._gi_profile(gpu, profile)
        if prof is None:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_gi_profile(self._struct(out, nvmlGpuInstanceProfileInfo_t), gpu, prof)

    @_c_function(P, U, P)
    def nvmlDeviceGetGpuInstanceProfileInfoV(self, handle, profile, out):
        gpu, err = self._mig_gpu(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        info = self._struct(out, nvmlGpuInstanceProfileInfo_v2_t)
        if info.version != GI_PROFILE_INFO_V2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        prof = self._gi_profile(gpu, profile)
        if prof is None:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_gi_profile(info, gpu, prof)

    @_c_function(P, U, P, P)
    def nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle, profile_id, out, count):
        gpu, err = self._mig_on(handle)
        if err:
            return err
        prof = self._host._profile_by_id(gpu, profile_id)
        if prof is None:
            return NVML_ERROR_INVALID_ARGUMENT
        _, memory_total = migcore.family_slices(gpu.family)
        starts = [s for s in prof.starts if s + prof.size <= memory_total]
        if out:
            array = (nvmlGpuInstancePlacement_t * len(starts)).from_address(out)
            for i, s in enumerate(starts):
                array[i].start, array[i].size = s, prof.size
        return self._put(count, C.c_uint, len(starts))

    @_c_function(P, U, P, P)
    def nvmlDeviceGetGpuInstances(self, handle, profile_id, out, count):
        gpu, err = self._mig_on(handle)
        if err:
            return err
        if self._host._profile_by_id(gpu, profile_id) is None:
            return NVML_ERROR_INVALID_ARGUMENT
        found = [gi for gi in gpu.gis if gi.profile_id == profile_id]
        if found and not out:
            return NVML_ERROR_INVALID_ARGUMENT
        for i, gi in enumerate(found):
            C.c_void_p.from_address(out + i * C.sizeof(C.c_void_p)).value = self._handle(("gi", gpu.index, gi.id))
        return self._put(count, C.c_uint, len(found))

    def _create(self, handle, profile_id, start, out) -> int:
        gpu, err = self._mig_on(handle)
        if err:
            return err
        prof = self._host._profile_by_id(gpu, profile_id)
        if prof is None:
            return NVML_ERROR_INVALID_ARGUMENT
        gi = self._host._create_gi(gpu, prof, start)
        self._host.calls.append(("create_gi", gpu.index, prof.name, start, prof.size))
        if isinstance(gi, int):
            return gi
        self._host.save()
        return self._put(out, C.c_void_p, self._handle(("gi", gpu.index, gi.id)))

    @_c_function(P, U, P)
    def nvmlDeviceCreateGpuInstance(self, handle, profile_id, out):
        return self._create(handle, profile_id, None, out)

    @_c_function(P, U, P, P)
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle, profile_id, placement, out):
        if not placement:
            return NVML_ERROR_INVALID_ARGUMENT
        p = nvmlGpuInstancePlacement_t.from_address(placement)
        gpu, err = self._mig_on(handle)
        if err:
            return err
        prof = self._host._profile_by_id(gpu, profile_id)
        if prof is None or p.size != prof.size:
            return NVML_ERROR_INVALID_ARGUMENT
        return self._create(handle, profile_id, int(p.start), out)

    def _gi(self, handle) -> tuple[SimGpu | None, SimGpuInstance | None, int]:
        if self._refcount <= 0:
            return None, None, NVML_ERROR_UNINITIALIZED
        key = self._key(handle)
        if key is None or key[0] != "gi":
            return None, None, NVML_ERROR_INVALID_ARGUMENT
        gpu = self._host.gpus[key[1]]
        gi = next((g for g in gpu.gis if g.id == key[2]), None)
        if gi is None:
            return None, None, NVML_ERROR_INVALID_ARGUMENT  # destroyed: a stale handle
        return gpu, gi, NVML_SUCCESS

    @_c_function(P, P)
    def nvmlGpuInstanceGetInfo(self, handle, out):
        gpu, gi, err = self._gi(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        info = self._struct(out, nvmlGpuInstanceInfo_t)
        info.device = self._handle(("gpu", gpu.index))
        info.id, info.profileId = gi.id, gi.profile_id
        info.placement.start, info.placement.size = gi.start, gi.size

    @_c_function(P)
    def nvmlGpuInstanceDestroy(self, handle):
        gpu, gi, err = self._gi(handle)
        if err:
            return err
        if gi.cis:
            return NVML_ERROR_IN_USE
        gpu.gis.remove(gi)
        self._host.calls.append(("destroy_gi", gpu.index, gi.id))
        self._host.save()

    def _fill_ci_profile(self, info, gi: SimGpuInstance, slices: int, enum: int) -> None:
        info.id = enum
        info.sliceCount = slices
        info.instanceCount = gi.compute // slices
        info.multiprocessorCount = slices * 16
        info.sharedCopyEngineCount = max(1, gi.compute)
        info.sharedDecoderCount = gi.compute if gi.compute > 1 or gi.media else 0
        info.sharedEncoderCount = 0
        info.sharedJpegCount = info.sharedOfaCount = int(gi.media)
        if hasattr(info, "name"):
            info.name = f"MIG {slices}c.{gi.compute}g".encode()

    def _ci_slices(self, gpu: SimGpu, gi: SimGpuInstance, profile: int) -> int | None:
        """Compute slices of CI profile `profile` in `gi`: the GI profile's own (covering all of it), or a smaller
        standard one; None when the GI has no such CI profile."""
        prof = migcore.profile_by_id(gpu.family, gi.profile_id)
        if prof is not None and prof.nvml_ci_value == profile:
            return gi.compute
        slices = CI_SLICES.get(profile)
        return slices if profile < 7 and slices is not None and slices < gi.compute else None

    @_c_function(P, U, U, P)
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, handle, profile, eng, out):
        gpu, gi, err = self._gi(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        slices = self._ci_slices(gpu, gi, profile)
        if slices is None or eng != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_ci_profile(self._struct(out, nvmlComputeInstanceProfileInfo_t), gi, slices, profile)

    @_c_function(P, U, U, P)
    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, handle, profile, eng, out):
        gpu, gi, err = self._gi(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        info = self._struct(out, nvmlComputeInstanceProfileInfo_v2_t)
        if info.version != CI_PROFILE_INFO_V2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        slices = self._ci_slices(gpu, gi, profile)
        if slices is None or eng != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_ci_profile(info, gi, slices, profile)

    @_c_function(P, U, P, P)
    def nvmlGpuInstanceGetComputeInstances(self, handle, profile_id, out, count):
        gpu, gi, err = self._gi(handle)
        if err:
            return err
        found = [c for c in gi.cis if c.profile_id == profile_id]
        if found and not out:
            return NVML_ERROR_INVALID_ARGUMENT
        for i, ci in enumerate(found):
            C.c_void_p.from_address(out + i * C.sizeof(C.c_void_p)).value = self._handle(
                ("ci", gpu.index, gi.id, ci.id)
            )
        return self._put(count, C.c_uint, len(found))

    @_c_function(P, U, P)
    def nvmlGpuInstanceCreateComputeInstance(self, handle, profile_id, out):
        gpu, gi, err = self._gi(handle)
        if err:
            return err
        slices = self._ci_slices(gpu, gi, profile_id)
        if slices is None:
            return NVML_ERROR_INVALID_ARGUMENT
        self._host.calls.append(("create_ci", gpu.index, gi.id, profile_id))
        if sum(c.slices for c in gi.cis) + slices > gi.compute:
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        ids = {c.id for c in gi.cis}
        ci = SimComputeInstance(
            id=next(i for i in itertools.count(0) if i not in ids), profile_id=profile_id, slices=slices
        )
        gi.cis.append(ci)
        self._host.save()
        return self._put(out, C.c_void_p, self._handle(("ci", gpu.index, gi.id, ci.id)))

    def _ci(self, handle):
        if self._refcount <= 0:
            return None, None, None, NVML_ERROR_UNINITIALIZED
        key = self._key(handle)
        if key is None or key[0] != "ci":
            return None, None, None, NVML_ERROR_INVALID_ARGUMENT
        gpu = self._host.gpus[key[1]]
        gi = next((g for g in gpu.gis if g.id == key[2]), None)
        ci = next((c for c in gi.cis if c.id == key[3]), None) if gi else None
        if ci is None:
            return None, None, None, NVML_ERROR_INVALID_ARGUMENT
        return gpu, gi, ci, NVML_SUCCESS

    @_c_function(P, P)
    def nvmlComputeInstanceGetInfo_v2(self, handle, out):
        gpu, gi, ci, err = self._ci(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        info = self._struct(out, nvmlComputeInstanceInfo_t)
        info.device = self._handle(("gpu", gpu.index))
        info.gpuInstance = self._handle(("gi", gpu.index, gi.id))
        info.id, info.profileId = ci.id, ci.profile_id
        info.placement.start, info.placement.size = 0, ci.slices

    @_c_function(P)
    def nvmlComputeInstanceDestroy(self, handle):
        gpu, gi, ci, err = self._ci(handle)
        if err:
            return err
        gi.cis.remove(ci)
        self._host.calls.append(("destroy_ci", gpu.index, gi.id, ci.id))
        self._host.save()

    def _mig_devices(self, gpu: SimGpu) -> list[tuple[int, int]]:
        return sorted((gi.id, ci.id) for gi in gpu.gis for ci in gi.cis)

    @_c_function(P, P)
    def nvmlDeviceGetMaxMigDeviceCount(self, handle, out):
        gpu, err = self._device(handle)
        if err:
            return err
        compute_total = migcore.family_slices(gpu.family)[0] if gpu.mig_capable and gpu.family else 0
        return self._put(out, C.c_uint, compute_total)

    @_c_function(P, U, P)
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index, out):
        gpu, err = self._mig_on(handle)
        if err:
            return err
        devices = self._mig_devices(gpu)
        if not 0 <= index < len(devices):
            return NVML_ERROR_NOT_FOUND
        gi_id, ci_id = devices[index]
        return self._put(out, C.c_void_p, self._handle(("mig", gpu.index, gi_id, ci_id)))

    def _mig_key(self, handle):
        if self._refcount <= 0:
            return None, NVML_ERROR_UNINITIALIZED
        key = self._key(handle)
        if key is None or key[0] != "mig":
            return None, NVML_ERROR_INVALID_ARGUMENT  # not a MIG device handle
        return key, NVML_SUCCESS

    @_c_function(P, P)
    def nvmlDeviceGetGpuInstanceId(self, handle, out):
        key, err = self._mig_key(handle)
        return err or self._put(out, C.c_uint, key[2])

    @_c_function(P, P)
    def nvmlDeviceGetComputeInstanceId(self, handle, out):
        key, err = self._mig_key(handle)
        return err or self._put(out, C.c_uint, key[3])

    @_c_function(P, P)
    def nvmlDeviceIsMigDeviceHandle(self, handle, out):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        key = self._key(handle)
        return self._put(out, C.c_uint, int(key is not None and key[0] == "mig"))

    # ---------------------------------------------------------------- health

    @_c_function(P)
    def nvmlEventSetCreate(self, out):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        key = ("eventset", len(self._cells))
        self._host._sets = getattr(self._host, "_sets", {})
        self._host._sets[key] = set()
        return self._put(out, C.c_void_p, self._handle(key))

    @_c_function(P)
    def nvmlEventSetFree(self, handle):
        key = self._key(handle)
        if key is None or key[0] != "eventset":
            return NVML_ERROR_INVALID_ARGUMENT
        getattr(self._host, "_sets", {}).pop(key, None)

    @_c_function(P, ULL, P)
    def nvmlDeviceRegisterEvents(self, handle, types, event_set):
        gpu, err = self._device(handle)
        if err:
            return err
        key = self._key(event_set)
        sets = getattr(self._host, "_sets", {})
        if key not in sets:
            return NVML_ERROR_INVALID_ARGUMENT
        if types & ~NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
            return NVML_ERROR_NOT_SUPPORTED
        sets[key].add(gpu.index)

    @_c_function(P, P, U)
    def nvmlEventSetWait_v2(self, event_set, out, timeout_ms):
        key = self._key(event_set)
        sets = getattr(self._host, "_sets", {})
        if key not in sets or not out:
            return NVML_ERROR_INVALID_ARGUMENT
        cond = self._host._event_cond
        if not cond.wait_for(lambda: any(e[0] in sets.get(key, ()) for e in self._host._events), timeout_ms / 1000):
            return NVML_ERROR_TIMEOUT
        event = next(e for e in self._host._events if e[0] in sets[key])
        self._host._events.remove(event)
        data = self._struct(out, nvmlEventData_t)
        data.device = self._handle(("gpu", event[0]))
        data.eventType, data.eventData = event[1], event[2]
        data.gpuInstanceId = data.computeInstanceId = 0xFFFFFFFF

    @_c_function(P, U, U, P)
    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type, out):
        gpu, err = self._device(handle)
        if err:
            return err
        if gpu.compute_capability < (7, 0) or gpu.compute_capability == (8, 9) or gpu.compute_capability == (8, 6):
            return NVML_ERROR_NOT_SUPPORTED  # consumer and workstation parts without ECC reporting
        return self._put(out, C.c_ulonglong, gpu.ecc.get((error_type, counter_type), 0))

    @_c_function(P, P)
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
        gpu, err = self._device(handle)
        return err or self._put(out, C.c_ulonglong, gpu.clocks_event_reasons)

    @_c_function(P, P)
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle, out):
        gpu, err = self._device(handle)
        return err or self._put(out, C.c_ulonglong, gpu.clocks_event_reasons)


def c_functions() -> dict[str, tuple]:
    """Every C function the simulated library has, with its nvml.h parameter types."""
    return {name: fn.c_argtypes for name, fn in vars(NvmlFunctions).items() if hasattr(fn, "c_argtypes")}


# ------------------------------------------------------------------------------------------------ binding


def load_bindings(name: str = "") -> Any:
    """A private instance of the installed nvidia-ml-py `pynvml` module: the same file, its own globals."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise ImportError("nvidia-ml-py (pynvml) is not installed")
    private = importlib.util.spec_from_file_location(name or f"pynvml_simulated_{next(_counter)}", spec.origin)
    module = importlib.util.module_from_spec(private)
    sys.modules[private.name] = module  # the binding looks itself up there while it is imported
    try:
        private.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.modules.pop(private.name, None)
    return module


_counter = itertools.count()


def bind(host: SimulatedHost, bindings: Any = None) -> Any:
    """The real pynvml over `host`: a private module instance (or `bindings`) whose library is simulated."""
    module = bindings if bindings is not None else load_bindings()
    module.nvmlLib = SimulatedNvmlLibrary(host)
    cache = getattr(module, "_nvmlGetFunctionPointer_cache", None)
    if isinstance(cache, dict):
        cache.clear()
    module.simulated_host = host
    return module


def unbind(module: Any) -> None:
    """Forget the simulated library (a later call raises NVMLError_Uninitialized as before any load)."""
    module.nvmlLib = None
    cache = getattr(module, "_nvmlGetFunctionPointer_cache", None)
    if isinstance(cache, dict):
        cache.clear()
