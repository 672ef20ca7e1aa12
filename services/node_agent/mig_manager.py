"""MIG instances for ranks on partial GPUs: find or create them before a rank starts, destroy them after.

One interface, two backends, and a manager:

- `MigBackend`: `list_instances(gpu)`, `ensure_instance(gpu, profile, start, size) -> MIG device UUID` (find the
  GPU instance at that placement or create it, plus a compute instance covering it) and
  `release_instance(gpu, start, size)` (destroy the compute and GPU instances there).
- `NvmlMigBackend`: the real thing through nvidia-ml-py (`pynvml`), for hosts whose topology came from NVML.
  MIG mode must already be enabled on the GPU (that needs a GPU reset, so it is an administrator's job); when it
  is not, `ensure_instance` raises MigError with a message that says so.
- `FakeMigBackend`: simulated hosts and tests. Same calls, the real profile rules (phalanx.core.mig): it refuses
  an invalid start or an overlapping placement as NVML would, and returns deterministic UUIDs
  `MIG-<uuid5 of node/gpu/start/profile>`. Its state can live in a file, so it survives an agent restart the way a
  real GPU's instances do.
- `MigManager`: which rank of this agent uses which instance. It validates a rank's slices against the GPU's MIG
  family, reconfigures the GPU where the wanted placement overlaps instances no rank of this agent uses (they are
  destroyed first), refuses to touch a GPU that a whole-GPU or fractional rank of this agent is using, and destroys
  an instance when the last rank using it ends, provided this agent created it (an instance that was there before,
  e.g. set up by an administrator, is left alone).

Every failure is a MigError, which the agent turns into a FAILED_TO_START report; nothing here ends the agent.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.mig import FULL_MASK, MEMORY_SLICES, MigProfile, family_profiles, mig_family, resolve

log = structlog.get_logger()

_NAMESPACE = uuid.UUID("3f0c7a52-9d1e-4c55-8b0e-6d2b6a51c0de")
_PROFILE_NAME = re.compile(r"^(\d+)g\.(\d+)gb$")
# (compute slices, memory slices) of each GPU instance shape -> pynvml constant names.
_GI_PROFILES = {
    (1, 1): "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    (1, 2): "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    (2, 2): "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    (3, 4): "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    (4, 4): "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    (7, 8): "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
}
# compute slices -> the compute instance profile that covers a whole GPU instance of that many compute slices.
_CI_PROFILES = {
    1: "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE",
    2: "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
    3: "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE",
    4: "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
    7: "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
}
_COMPUTE_SLICES = 7


class MigError(RuntimeError):
    """A MIG operation failed; the rank that needed it cannot start."""


@dataclass(frozen=True)
class MigInstance:
    gpu: int
    profile: str
    start: int
    size: int
    uuid: str = ""  # the MIG device UUID; "" while the GPU instance has no compute instance
    gi_id: int = -1

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


def placement_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def fake_mig_uuid(node_name: str, gpu: int, start: int, profile: str) -> str:
    return f"MIG-{uuid.uuid5(_NAMESPACE, f'{node_name}/{gpu}/{start}/{profile.lower()}')}"


def _compute_of(profile: str) -> int:
    m = _PROFILE_NAME.match(profile.lower())
    if not m:
        raise MigError(f"{profile!r} is not a MIG profile name (like 3g.40gb)")
    return int(m.group(1))


def _gpus_of(topology: agent_pb2.HostTopology) -> dict[int, tuple[str, int]]:
    return {g.index: (g.name, g.memory_mib) for g in topology.gpus}


class MigBackend(ABC):
    kind = "abstract"

    @abstractmethod
    def list_instances(self, gpu: int) -> list[MigInstance]:
        """The GPU instances on GPU `gpu` (with their MIG device UUIDs where they have a compute instance)."""

    @abstractmethod
    def ensure_instance(self, gpu: int, profile: str, start: int, size: int) -> str:
        """The MIG device UUID of the instance of `profile` at (start, size) on `gpu`, created if missing."""

    @abstractmethod
    def release_instance(self, gpu: int, start: int, size: int) -> None:
        """Destroy the compute and GPU instances at (start, size) on `gpu`."""


# ------------------------------------------------------------------------------------------------ fake


class FakeMigBackend(MigBackend):
    """MIG on simulated GPUs, with the real profile rules; optionally persisted in `state_file`."""

    kind = "simulated"

    def __init__(
        self,
        node_name: str,
        gpus: dict[int, tuple[str, int]],
        state_file: str | Path | None = None,
        mig_disabled: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.node_name = node_name
        self.gpus = dict(gpus)
        self.mig_disabled = set(mig_disabled)
        self.state_file = Path(state_file) if state_file else None
        self._instances: dict[int, list[MigInstance]] = {}
        self.calls: list[tuple] = []  # (operation, gpu, profile, start, size), for tests
        self._load()

    @classmethod
    def for_topology(cls, node_name: str, topology: agent_pb2.HostTopology, state_file=None) -> FakeMigBackend:
        return cls(node_name, _gpus_of(topology), state_file)

    def _load(self) -> None:
        if not self.state_file or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
            for gpu, items in data.get("instances", {}).items():
                self._instances[int(gpu)] = [MigInstance(**i) for i in items]
        except (OSError, ValueError, TypeError) as exc:
            log.warning("fake_mig_state_unreadable", path=str(self.state_file), error=str(exc))

    def _save(self) -> None:
        if not self.state_file:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        data = {"instances": {str(g): [asdict(i) for i in items] for g, items in self._instances.items() if items}}
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.state_file)

    def _family(self, gpu: int) -> str:
        if gpu not in self.gpus:
            raise MigError(f"GPU {gpu} does not exist on this host (Invalid Argument)")
        name, memory = self.gpus[gpu]
        family = mig_family(name, memory)
        if family is None:
            raise MigError(f"GPU {gpu} ({name}) does not support MIG (Not Supported)")
        if gpu in self.mig_disabled:
            raise MigError(f"MIG mode is not enabled on GPU {gpu} ({name}); enable it with "
                           f"`nvidia-smi -i {gpu} -mig 1` (a GPU reset follows)")
        return family

    def list_instances(self, gpu: int) -> list[MigInstance]:
        self._family(gpu)
        return sorted(self._instances.get(gpu, []), key=lambda i: i.start)

    def ensure_instance(self, gpu: int, profile: str, start: int, size: int) -> str:
        family = self._family(gpu)
        prof = resolve(profile, family)
        if prof is None:
            raise MigError(f"GPU {gpu} ({family}) has no MIG profile {profile!r} (Not Supported); "
                           f"its profiles: {', '.join(family_profiles(family))}")
        if size and size != prof.size:
            raise MigError(f"profile {prof.name} takes {prof.size} memory slices, not {size} (Invalid Argument)")
        if start not in prof.starts:
            raise MigError(f"{prof.name} cannot start at memory slice {start} on GPU {gpu}; valid starts: "
                           f"{','.join(map(str, prof.starts))} (Invalid Argument)")
        instances = self._instances.setdefault(gpu, [])
        for inst in instances:
            if inst.start == start and inst.size == prof.size and inst.profile == prof.name:
                return inst.uuid
        mask = prof.mask(start)
        for inst in instances:
            if inst.mask & mask:
                raise MigError(f"{prof.name} at slices {start}-{start + prof.size - 1} of GPU {gpu} overlaps "
                               f"instance {inst.profile} at {inst.start}-{inst.start + inst.size - 1} "
                               "(Insufficient Resources)")
        compute = sum(_compute_of(i.profile) for i in instances)
        if compute + prof.compute > _COMPUTE_SLICES:
            raise MigError(f"GPU {gpu} has {_COMPUTE_SLICES - compute} free compute slices, {prof.name} needs "
                           f"{prof.compute} (Insufficient Resources)")
        used_ids = {i.gi_id for i in instances}
        gi_id = next(n for n in range(1, 64) if n not in used_ids)
        inst = MigInstance(gpu=gpu, profile=prof.name, start=start, size=prof.size,
                           uuid=fake_mig_uuid(self.node_name, gpu, start, prof.name), gi_id=gi_id)
        instances.append(inst)
        self.calls.append(("create", gpu, prof.name, start, prof.size))
        self._save()
        return inst.uuid

    def release_instance(self, gpu: int, start: int, size: int) -> None:
        self._family(gpu)
        instances = self._instances.get(gpu, [])
        for inst in instances:
            if inst.start == start and inst.size == size:
                instances.remove(inst)
                self.calls.append(("destroy", gpu, inst.profile, start, size))
                self._save()
                return
        raise MigError(f"no MIG instance at slices {start}-{start + size - 1} of GPU {gpu} (Not Found)")

    def used_mask(self, gpu: int) -> int:
        mask = 0
        for inst in self._instances.get(gpu, []):
            mask |= inst.mask
        return mask & FULL_MASK


# ------------------------------------------------------------------------------------------------ NVML


class NvmlMigBackend(MigBackend):
    """MIG through NVML. `nvml` is the pynvml module (a stand-in in tests); NVML is initialised on first use."""

    kind = "nvml"

    def __init__(self, gpus: dict[int, tuple[str, int]] | None = None, nvml=None) -> None:
        self.gpus = dict(gpus or {})
        self._nv = nvml
        self._ready = False

    @classmethod
    def for_topology(cls, topology: agent_pb2.HostTopology, nvml=None) -> NvmlMigBackend:
        return cls(_gpus_of(topology), nvml)

    # ---------------------------------------------------------------- plumbing

    def _lib(self):
        if self._nv is None:
            try:
                import pynvml
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise MigError("nvidia-ml-py (pynvml) is not installed") from exc
            self._nv = pynvml
        nv = self._nv
        if not self._ready:
            try:
                nv.nvmlInit()
            except nv.NVMLError as exc:
                raise MigError(f"cannot initialise NVML ({exc}): no NVIDIA driver on this host?") from exc
            self._ready = True
        return nv

    def _call(self, what: str, fn, *args):
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            raise MigError(f"{what}: {exc}") from exc

    def _device(self, nv, gpu: int, *, check_mode: bool = True):
        handle = self._call(f"GPU {gpu}", nv.nvmlDeviceGetHandleByIndex, gpu)
        if check_mode:
            try:
                current, pending = nv.nvmlDeviceGetMigMode(handle)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                    raise MigError(f"GPU {gpu} does not support MIG") from exc
                raise MigError(f"cannot read the MIG mode of GPU {gpu}: {exc}") from exc
            if current != nv.NVML_DEVICE_MIG_ENABLE:
                hint = ("it is pending: reset the GPU (nvidia-smi -i {g} -r) to apply it" if
                        pending == nv.NVML_DEVICE_MIG_ENABLE else "enable it with `nvidia-smi -i {g} -mig 1`")
                raise MigError(f"MIG mode is not enabled on GPU {gpu}; " + hint.format(g=gpu))
        return handle

    def _gi_profile_info(self, nv, handle, shape: tuple[int, int]):
        const = getattr(nv, _GI_PROFILES[shape])
        try:
            return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, const)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", object()):
                raise
        return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, const, 1)  # drivers without the V call

    def _gpu_instances(self, nv, handle, info) -> list:
        n = max(int(getattr(info, "instanceCount", 0) or 0), MEMORY_SLICES)
        array = (nv.c_nvmlGpuInstance_t * n)()
        count = ctypes.c_uint(0)
        nv.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
        return [array[i] for i in range(count.value)]

    def _ci_profile_info(self, nv, gi, compute: int):
        return nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, getattr(nv, _CI_PROFILES[compute]), nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)

    def _compute_instances(self, nv, gi, ci_info) -> list:
        n = max(int(getattr(ci_info, "instanceCount", 0) or 0), 1)
        array = (nv.c_nvmlComputeInstance_t * n)()
        count = ctypes.c_uint(0)
        nv.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id, array, ctypes.byref(count))
        return [array[i] for i in range(count.value)]

    def _mig_uuid(self, nv, handle, gi_id: int) -> str:
        for i in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nv.NVMLError:
                continue  # no MIG device at this index
            if int(nv.nvmlDeviceGetGpuInstanceId(mig)) == gi_id:
                raw = nv.nvmlDeviceGetUUID(mig)
                return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return ""

    def _profile_name(self, gpu: int, shape: tuple[int, int], info) -> str:
        name, memory = self.gpus.get(gpu, ("", 0))
        family = mig_family(name, memory) if name else None
        for prof in family_profiles(family).values() if family else ():
            if (prof.compute, prof.size) == shape:
                return prof.name
        gb = round(int(getattr(info, "memorySizeMB", 0) or 0) / 1024)
        return f"{shape[0]}g.{gb}gb"

    def _find(self, nv, handle, gpu: int, shape: tuple[int, int], start: int):
        """(gi handle, gi id) of the GPU instance of `shape` at `start`, or None."""
        info = self._gi_profile_info(nv, handle, shape)
        for gi in self._gpu_instances(nv, handle, info):
            gi_info = nv.nvmlGpuInstanceGetInfo(gi)
            if int(gi_info.placement.start) == start and int(gi_info.placement.size) == shape[1]:
                return gi, int(gi_info.id)
        return None

    # ---------------------------------------------------------------- interface

    def list_instances(self, gpu: int) -> list[MigInstance]:
        nv = self._lib()
        try:
            handle = self._device(nv, gpu)
            out: list[MigInstance] = []
            for shape in _GI_PROFILES:
                try:
                    info = self._gi_profile_info(nv, handle, shape)
                except nv.NVMLError:
                    continue  # this GPU has no such profile
                for gi in self._gpu_instances(nv, handle, info):
                    gi_info = nv.nvmlGpuInstanceGetInfo(gi)
                    out.append(MigInstance(
                        gpu=gpu, profile=self._profile_name(gpu, shape, info),
                        start=int(gi_info.placement.start), size=int(gi_info.placement.size),
                        uuid=self._mig_uuid(nv, handle, int(gi_info.id)), gi_id=int(gi_info.id),
                    ))
            return sorted(out, key=lambda i: i.start)
        except nv.NVMLError as exc:
            raise MigError(f"cannot list the MIG instances of GPU {gpu}: {exc}") from exc

    def ensure_instance(self, gpu: int, profile: str, start: int, size: int) -> str:
        nv = self._lib()
        shape = (_compute_of(profile), size)
        if shape not in _GI_PROFILES:
            raise MigError(f"no MIG GPU instance profile has {shape[0]} compute and {size} memory slices "
                           f"({profile})")
        handle = self._device(nv, gpu)
        try:
            info = self._gi_profile_info(nv, handle, shape)
        except nv.NVMLError as exc:
            raise MigError(f"GPU {gpu} has no MIG profile {profile}: {exc}") from exc
        try:
            found = self._find(nv, handle, gpu, shape, start)
            if found is None:
                placement = nv.c_nvmlGpuInstancePlacement_t()
                placement.start, placement.size = start, size
                try:
                    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
                except nv.NVMLError as exc:
                    raise MigError(f"cannot create MIG instance {profile} at slices {start}-{start + size - 1} "
                                   f"of GPU {gpu}: {exc}") from exc
                gi_id = int(nv.nvmlGpuInstanceGetInfo(gi).id)
                log.info("mig_gpu_instance_created", gpu=gpu, profile=profile, start=start, size=size, gi=gi_id)
            else:
                gi, gi_id = found
            mig_uuid = self._mig_uuid(nv, handle, gi_id) if found is not None else ""
            if not mig_uuid:  # no compute instance yet: one covering the whole GPU instance
                ci_info = self._ci_profile_info(nv, gi, shape[0])
                try:
                    nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
                except nv.NVMLError as exc:
                    if found is None:  # do not leave the GPU instance just made behind
                        try:
                            nv.nvmlGpuInstanceDestroy(gi)
                        except nv.NVMLError:
                            pass
                    raise MigError(f"cannot create the compute instance of MIG instance {profile} on GPU "
                                   f"{gpu}: {exc}") from exc
                mig_uuid = self._mig_uuid(nv, handle, gi_id)
        except nv.NVMLError as exc:
            raise MigError(f"MIG instance {profile} at slice {start} of GPU {gpu}: {exc}") from exc
        if not mig_uuid:
            raise MigError(f"MIG instance {profile} at slice {start} of GPU {gpu} has no MIG device")
        return mig_uuid

    def release_instance(self, gpu: int, start: int, size: int) -> None:
        nv = self._lib()
        handle = self._device(nv, gpu)
        try:
            for shape in _GI_PROFILES:
                if shape[1] != size:
                    continue
                try:
                    found = self._find(nv, handle, gpu, shape, start)
                except nv.NVMLError:
                    continue  # no such profile on this GPU
                if found is None:
                    continue
                gi, gi_id = found
                for compute in sorted(_CI_PROFILES):
                    try:
                        ci_info = self._ci_profile_info(nv, gi, compute)
                    except nv.NVMLError:
                        continue
                    for ci in self._compute_instances(nv, gi, ci_info):
                        nv.nvmlComputeInstanceDestroy(ci)
                nv.nvmlGpuInstanceDestroy(gi)
                log.info("mig_gpu_instance_destroyed", gpu=gpu, start=start, size=size, gi=gi_id)
                return
        except nv.NVMLError as exc:
            raise MigError(f"cannot destroy the MIG instance at slices {start}-{start + size - 1} of GPU {gpu}: "
                           f"{exc}") from exc
        raise MigError(f"no MIG instance at slices {start}-{start + size - 1} of GPU {gpu}")


def backend_for(topology: agent_pb2.HostTopology, node_name: str, state_dir: Path | None = None) -> MigBackend:
    """NVML for a host discovered through NVML (profile "nvml"), the fake for simulated ones."""
    if topology.profile == "nvml":
        return NvmlMigBackend.for_topology(topology)
    state_file = Path(state_dir) / "mig-sim.json" if state_dir is not None else None
    return FakeMigBackend.for_topology(node_name, topology, state_file)


# ------------------------------------------------------------------------------------------------ manager


def _placement(s: dict) -> tuple[int, int, int]:
    return int(s["gpu"]), int(s["start"]), int(s["size"])


class MigManager:
    """The MIG instances the ranks of one agent use. Thread-safe (the agent calls it from worker threads)."""

    def __init__(self, backend: MigBackend, topology: agent_pb2.HostTopology) -> None:
        self.backend = backend
        self.gpus = _gpus_of(topology)
        self._lock = threading.RLock()
        self._users: dict[tuple[int, int, int], set[str]] = {}  # (gpu, start, size) -> rank keys
        self._owned: set[tuple[int, int, int]] = set()  # instances this agent created

    def mig_gpus(self) -> list[int]:
        return sorted(g for g, (name, mem) in self.gpus.items() if mig_family(name, mem))

    def users(self, gpu: int, start: int, size: int) -> set[str]:
        with self._lock:
            return set(self._users.get((gpu, start, size), ()))

    def validate(self, slices: list[dict]) -> list[MigProfile]:
        """The profile of each slice on its GPU; MigError when a slice cannot exist there."""
        out = []
        for s in slices:
            gpu, start, size = _placement(s)
            if gpu not in self.gpus:
                raise MigError(f"MIG slice on GPU {gpu}, which this host does not have")
            name, memory = self.gpus[gpu]
            family = mig_family(name, memory)
            if family is None:
                raise MigError(f"GPU {gpu} ({name}) does not support MIG")
            prof = resolve(str(s["profile"]), family)
            if prof is None:
                raise MigError(f"GPU {gpu} ({name}, {family}) has no MIG profile {s['profile']!r}; "
                               f"its profiles: {', '.join(family_profiles(family))}")
            if size and size != prof.size:
                raise MigError(f"MIG profile {prof.name} takes {prof.size} memory slices, not {size}")
            if start not in prof.starts or start < 0 or start + prof.size > MEMORY_SLICES:
                raise MigError(f"MIG profile {prof.name} cannot start at memory slice {start} "
                               f"(valid starts {','.join(map(str, prof.starts))})")
            out.append(prof)
        return out

    def acquire(self, rank: str, slices: list[dict], busy_gpus: dict[int, str] | None = None) -> list[dict]:
        """Find or create the instances of `slices` for rank `rank`: the slices back, each with its MIG device
        `uuid` and whether this agent `created` it. `busy_gpus` maps GPUs that whole-GPU or fractional ranks of
        this agent use to one such rank: their geometry is not changed. On failure nothing stays acquired."""
        busy_gpus = busy_gpus or {}
        with self._lock:
            profiles = self.validate(slices)
            done: list[dict] = []
            try:
                for s, prof in zip(slices, profiles, strict=True):
                    done.append(self._acquire_one(rank, int(s["gpu"]), prof, int(s["start"]), busy_gpus))
            except Exception:
                self.release(rank, done)
                raise
            return done

    def _acquire_one(self, rank: str, gpu: int, prof: MigProfile, start: int, busy: dict[int, str]) -> dict:
        key = (gpu, start, prof.size)
        mask = prof.mask(start)
        existing = self.backend.list_instances(gpu)
        exact = next((i for i in existing if (i.start, i.size, i.profile) == (start, prof.size, prof.name)), None)
        if exact is None:
            if gpu in busy:
                raise MigError(f"GPU {gpu} is in use by rank {busy[gpu]} (whole GPU or fractional share): its MIG "
                               "geometry cannot change while a rank uses it")
            for inst in existing:
                if not inst.mask & mask:
                    continue
                users = self._users.get((inst.gpu, inst.start, inst.size))
                if users:
                    raise MigError(f"{prof.name} at slices {start}-{start + prof.size - 1} of GPU {gpu} overlaps "
                                   f"MIG instance {inst.profile} at {inst.start}-{inst.start + inst.size - 1}, "
                                   f"in use by rank {sorted(users)[0]}")
            for inst in existing:
                if inst.mask & mask:  # no rank of ours uses it: reconfigure
                    log.info("mig_reconfigure", gpu=gpu, destroy=inst.profile, start=inst.start,
                             wanted=prof.name, wanted_start=start)
                    self.backend.release_instance(inst.gpu, inst.start, inst.size)
                    self._owned.discard((inst.gpu, inst.start, inst.size))
        elif self._users.get(key):
            log.warning("mig_instance_shared", gpu=gpu, profile=prof.name, start=start, rank=rank,
                        users=sorted(self._users[key]))
        mig_uuid = self.backend.ensure_instance(gpu, prof.name, start, prof.size)
        if exact is None:
            self._owned.add(key)
        self._users.setdefault(key, set()).add(rank)
        return {"gpu": gpu, "profile": prof.name, "start": start, "size": prof.size, "uuid": mig_uuid,
                "created": key in self._owned}

    def adopt(self, rank: str, slices: list[dict]) -> None:
        """A rank a restarted agent adopted uses these instances (nothing is created or destroyed)."""
        with self._lock:
            for s in slices:
                key = _placement(s)
                self._users.setdefault(key, set()).add(rank)
                if s.get("created"):
                    self._owned.add(key)

    def release(self, rank: str, slices: list[dict]) -> list[tuple[int, int, int]]:
        """Rank `rank` no longer uses `slices`: destroy each instance no other rank uses that this agent created.
        Returns the placements destroyed; failures are logged, never raised."""
        destroyed = []
        with self._lock:
            for s in slices:
                key = _placement(s)
                users = self._users.get(key)
                if users is not None:
                    users.discard(rank)
                    if users:
                        continue
                    del self._users[key]
                if key not in self._owned and not s.get("created"):
                    continue
                try:
                    self.backend.release_instance(*key)
                    destroyed.append(key)
                except Exception as exc:  # noqa: BLE001 - a leftover instance is reconfigured away later
                    log.warning("mig_release_failed", gpu=key[0], start=key[1], size=key[2], rank=rank,
                                error=str(exc))
                self._owned.discard(key)
        return destroyed

    def describe(self) -> dict[int, list[MigInstance]]:
        """The instances on each MIG-capable GPU (for logs); GPUs whose instances cannot be read are left out."""
        out = {}
        with self._lock:
            for gpu in self.mig_gpus():
                try:
                    out[gpu] = self.backend.list_instances(gpu)
                except MigError:
                    continue
        return out
