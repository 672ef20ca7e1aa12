"""The simulated hardware an NVML library answers for: GPUs (model traits, PCI bus ids, NUMA nodes), their NVLinks
and PCIe ancestry from a topo dump, the multi-node fabric, MIG instances with NVIDIA's placement rules (kept in a
state file across agent restarts), health events and what tests inject."""

from __future__ import annotations

import itertools
import json
import os
import threading
import uuid as uuidlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.core import mig as migcore
from phalanx.core.topo_dump import TopoDump, is_nvlink, nvlink_count

from ..sysfs import default_gpu_bus_ids
from .codes import (
    _ERROR_STRINGS,
    MAX_LINKS_PER_GPU,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_UNKNOWN,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_NVLINK_DEVICE_TYPE_GPU,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
    NVML_SUCCESS,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SYSTEM,
)

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
                error = _ERROR_STRINGS.get(gi, _ERROR_STRINGS[NVML_ERROR_UNKNOWN]).decode()
                raise ValueError(f"cannot create {profile} at {start} on GPU {gpu}: {error}")
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
