"""MIG instances for ranks on partial GPUs: find or create them before a rank starts, destroy them after.

- `NvmlMigBackend`: MIG through nvidia-ml-py (`pynvml`): the real module on a GPU host, a private instance of it
  bound to phalanx.simhost.nvml's simulated C library on a simulated one, so both run this code. MIG mode must be
  enabled on the GPU (switching it is `--mig-manage`'s job, or an administrator's); when it is not,
  `ensure_instance` raises MigError with a message that says so. Profiles, their NVML constants and ids come from
  phalanx.core.mig's tables (`+me` variants included).
- `MigManager`: which rank of this agent uses which instance, and which instances this agent created. It records
  each instance it creates (GPU, placement, GPU instance id, compute instance id) in the agent's state file, so the
  record survives restarts, and it never destroys any other instance: an instance it finds that it did not create
  (an administrator's, another tool's) is occupied by someone else. It refuses to change the geometry of a GPU that
  a whole-GPU or fractional rank of this agent uses, destroys an instance it created when the last rank using it
  ends, and at start destroys the instances it created that no live rank uses any more.

Every failure is a MigError, which the agent turns into a FAILED_TO_START report marked `retryable` (the host kept
the rank from starting; the scheduler requeues the gang elsewhere); nothing here ends the agent.
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid
from dataclasses import dataclass

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.mig import MigProfile, family_slices, family_table, mig_family, resolve

log = structlog.get_logger()

_NAMESPACE = uuid.UUID("3f0c7a52-9d1e-4c55-8b0e-6d2b6a51c0de")


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
    ci_id: int = -1

    @property
    def key(self) -> tuple[int, int, int]:
        return self.gpu, self.start, self.size

    @property
    def mask(self) -> int:
        return ((1 << self.size) - 1) << self.start


def placement_mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def fake_mig_uuid(node_name: str, gpu: int, start: int, profile: str) -> str:
    return f"MIG-{uuid.uuid5(_NAMESPACE, f'{node_name}/{gpu}/{start}/{profile.lower()}')}"


def _gpus_of(topology: agent_pb2.HostTopology) -> dict[int, tuple[str, int]]:
    return {g.index: (g.name, g.memory_mib) for g in topology.gpus}


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


class NvmlMigBackend:
    """MIG through NVML. `nvml` is the pynvml module (or a private instance over a simulated library); NVML is
    initialised on first use unless `initialised` (the caller holds an nvmlInit)."""

    kind = "nvml"

    def __init__(
        self,
        gpus: dict[int, tuple[str, int]] | None = None,
        nvml=None,
        *,
        initialised: bool = False,
        simulated: bool = False,
    ) -> None:
        self.gpus = dict(gpus or {})
        self._nv = nvml
        self._ready = initialised
        if simulated:
            self.kind = "nvml-simulated"

    @classmethod
    def for_topology(cls, topology: agent_pb2.HostTopology, nvml=None) -> NvmlMigBackend:
        return cls(_gpus_of(topology), nvml, simulated=topology.profile != "nvml")

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
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            raise MigError(f"{what}: {exc}") from exc

    def family(self, gpu: int) -> str | None:
        name, memory = self.gpus.get(gpu, ("", 0))
        return mig_family(name, memory) if name else None

    def profiles(self, gpu: int) -> list[MigProfile]:
        family = self.family(gpu)
        return list(family_table(family).values()) if family else []

    def _device(self, nv, gpu: int):
        handle = self._call(f"GPU {gpu}", nv.nvmlDeviceGetHandleByIndex, gpu)
        try:
            current, pending = nv.nvmlDeviceGetMigMode(handle)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                raise MigError(f"GPU {gpu} does not support MIG") from exc
            raise MigError(f"cannot read the MIG mode of GPU {gpu}: {exc}") from exc
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            hint = (
                "it is pending: reset the GPU (nvidia-smi -i {g} -r) to apply it"
                if pending == nv.NVML_DEVICE_MIG_ENABLE
                else "enable it with `nvidia-smi -i {g} -mig 1`"
            )
            raise MigError(f"MIG mode is not enabled on GPU {gpu}; " + hint.format(g=gpu))
        return handle

    def _gi_profile_info(self, nv, handle, prof: MigProfile):
        const = getattr(nv, prof.nvml_gi_profile)
        try:
            return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, const)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", object()):
                raise
        return nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, const, 1)  # drivers without the V call

    def _ci_profile_info(self, nv, gi, prof: MigProfile):
        const = getattr(nv, prof.nvml_ci_profile)
        engine = nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        try:
            return nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, const, engine)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", object()):
                raise
        return nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, const, engine, 1)

    @staticmethod
    def _array(nv, kind, n: int, fn, *args) -> list:
        array = (kind * max(n, 1))()
        count = ctypes.c_uint(0)
        fn(*args, array, ctypes.byref(count))
        return [array[i] for i in range(count.value)]

    def _mig_devices(self, nv, handle) -> dict[tuple[int, int], str]:
        """(GPU instance id, compute instance id) -> MIG device UUID, for every MIG device of the GPU."""
        out = {}
        for i in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nv.NVMLError:
                continue  # no MIG device at this index
            ids = (int(nv.nvmlDeviceGetGpuInstanceId(mig)), int(nv.nvmlDeviceGetComputeInstanceId(mig)))
            out[ids] = _text(nv.nvmlDeviceGetUUID(mig))
        return out

    def _instances(self, nv, handle, gpu: int) -> list[tuple[MigInstance, object, MigProfile]]:
        """(instance, GPU instance handle, profile) of every GPU instance on `gpu`."""
        devices = self._mig_devices(nv, handle)
        out = []
        for prof in self.profiles(gpu):
            try:
                info = self._gi_profile_info(nv, handle, prof)
            except nv.NVMLError:
                continue  # this GPU has no such profile
            n = int(getattr(info, "instanceCount", 0) or 0) or 8
            for gi in self._array(nv, nv.c_nvmlGpuInstance_t, n, nv.nvmlDeviceGetGpuInstances, handle, info.id):
                gi_info = nv.nvmlGpuInstanceGetInfo(gi)
                gi_id = int(gi_info.id)
                ci_id = next((c for g, c in sorted(devices) if g == gi_id), -1)
                out.append(
                    (
                        MigInstance(
                            gpu=gpu,
                            profile=prof.name,
                            start=int(gi_info.placement.start),
                            size=int(gi_info.placement.size),
                            uuid=devices.get((gi_id, ci_id), ""),
                            gi_id=gi_id,
                            ci_id=ci_id,
                        ),
                        gi,
                        prof,
                    )
                )
        return sorted(out, key=lambda t: t[0].start)

    # ---------------------------------------------------------------- interface

    def list_instances(self, gpu: int) -> list[MigInstance]:
        nv = self._lib()
        try:
            return [inst for inst, _, _ in self._instances(nv, self._device(nv, gpu), gpu)]
        except nv.NVMLError as exc:
            raise MigError(f"cannot list the MIG instances of GPU {gpu}: {exc}") from exc

    def create_instance(self, gpu: int, profile: str, start: int) -> MigInstance:
        """Create a GPU instance of `profile` at `start` and a compute instance covering it. On failure nothing
        it made is left behind."""
        nv = self._lib()
        prof = resolve(profile, self.family(gpu))
        if prof is None:
            raise MigError(f"GPU {gpu} has no MIG profile {profile!r}")
        handle = self._device(nv, gpu)
        try:
            info = self._gi_profile_info(nv, handle, prof)
        except nv.NVMLError as exc:
            raise MigError(f"GPU {gpu} has no MIG profile {profile}: {exc}") from exc
        placement = nv.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, prof.size
        try:
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
        except nv.NVMLError as exc:
            raise MigError(
                f"cannot create MIG instance {profile} at slices {start}-{start + prof.size - 1} of GPU {gpu}: {exc}"
            ) from exc
        try:
            gi_id = int(nv.nvmlGpuInstanceGetInfo(gi).id)
            ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, self._ci_profile_info(nv, gi, prof).id)
            ci_id = int(nv.nvmlComputeInstanceGetInfo(ci).id)
            mig_uuid = self._mig_devices(nv, handle).get((gi_id, ci_id), "")
            if not mig_uuid:
                raise MigError(f"MIG instance {profile} at slice {start} of GPU {gpu} shows no MIG device")
        except (nv.NVMLError, MigError) as exc:
            self._destroy(nv, gi)  # do not leave the GPU instance just made behind
            if isinstance(exc, MigError):
                raise
            raise MigError(f"cannot create the compute instance of MIG instance {profile} on GPU {gpu}: {exc}") from exc
        log.info("mig_instance_created", gpu=gpu, profile=profile, start=start, size=prof.size, gi=gi_id, ci=ci_id)
        return MigInstance(
            gpu=gpu, profile=prof.name, start=start, size=prof.size, uuid=mig_uuid, gi_id=gi_id, ci_id=ci_id
        )

    def _destroy(self, nv, gi) -> None:
        for const in (
            "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE",
            "NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE",
            "NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE",
            "NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE",
            "NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE",
            "NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1",
        ):
            if not hasattr(nv, const):
                continue
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, getattr(nv, const), nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except nv.NVMLError:
                continue  # no such CI profile in this GPU instance
            for ci in self._array(
                nv,
                nv.c_nvmlComputeInstance_t,
                int(info.instanceCount or 1),
                nv.nvmlGpuInstanceGetComputeInstances,
                gi,
                info.id,
            ):
                nv.nvmlComputeInstanceDestroy(ci)
        nv.nvmlGpuInstanceDestroy(gi)

    def destroy_instance(self, gpu: int, start: int, size: int, gi_id: int) -> None:
        """Destroy exactly the GPU instance `gi_id` at (start, size) on `gpu`, with its compute instances."""
        nv = self._lib()
        handle = self._device(nv, gpu)
        try:
            for inst, gi, _ in self._instances(nv, handle, gpu):
                if (inst.start, inst.size, inst.gi_id) == (start, size, gi_id):
                    self._destroy(nv, gi)
                    log.info("mig_instance_destroyed", gpu=gpu, start=start, size=size, gi=gi_id)
                    return
        except nv.NVMLError as exc:
            raise MigError(
                f"cannot destroy MIG instance {gi_id} at slices {start}-{start + size - 1} of GPU {gpu}: {exc}"
            ) from exc
        raise MigError(f"no MIG instance {gi_id} at slices {start}-{start + size - 1} of GPU {gpu}")

    def mode(self, gpu: int) -> tuple[int, int]:
        """(current, pending) MIG mode of `gpu` (NVML_DEVICE_MIG_DISABLE 0 / ENABLE 1)."""
        nv = self._lib()
        handle = self._call(f"GPU {gpu}", nv.nvmlDeviceGetHandleByIndex, gpu)
        current, pending = self._call(f"the MIG mode of GPU {gpu}", nv.nvmlDeviceGetMigMode, handle)
        return int(current), int(pending)

    def set_mode(self, gpu: int, enable: bool) -> tuple[int, int]:
        """Ask NVML to switch `gpu`'s MIG mode; the (current, pending) mode after it. NVML unbinds or resets the
        GPU to activate the mode where it can; where it cannot (pass-through VMs) the new mode stays pending until
        a GPU reset or reboot. MigError when NVML refuses (not idle: In Use; not root: No Permission)."""
        nv = self._lib()
        handle = self._call(f"GPU {gpu}", nv.nvmlDeviceGetHandleByIndex, gpu)
        mode = nv.NVML_DEVICE_MIG_ENABLE if enable else nv.NVML_DEVICE_MIG_DISABLE
        status = self._call(
            f"cannot switch MIG {'on' if enable else 'off'} on GPU {gpu}", nv.nvmlDeviceSetMigMode, handle, mode
        )
        if status not in (nv.NVML_SUCCESS, getattr(nv, "NVML_ERROR_RESET_REQUIRED", 16)):
            raise MigError(
                f"cannot switch MIG {'on' if enable else 'off'} on GPU {gpu}: activation failed "
                f"({nv.NVMLError(status)})"
            )
        return self.mode(gpu)


MigBackend = NvmlMigBackend


def backend_for(topology: agent_pb2.HostTopology, nvml=None) -> NvmlMigBackend:
    """NVML: the real pynvml on a discovered host, `nvml` (bound to a simulated library) on a simulated one."""
    return NvmlMigBackend.for_topology(topology, nvml)


# ------------------------------------------------------------------------------------------------ manager


def _placement(s: dict) -> tuple[int, int, int]:
    return int(s["gpu"]), int(s["start"]), int(s["size"])


class MigManager:
    """The MIG instances the ranks of one agent use. Thread-safe (the agent calls it from worker threads).

    `created` is the agent's record of the instances it made ({gpu, profile, start, size, gi_id, ci_id, uuid}); the
    agent keeps it in its state file (AgentState.mig_created) and hands the same list back after a restart."""

    def __init__(
        self,
        backend: NvmlMigBackend,
        topology: agent_pb2.HostTopology,
        created: list[dict] | None = None,
        on_change=None,
    ) -> None:
        self.backend = backend
        self.gpus = _gpus_of(topology)
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)  # notified whenever a rank gives instances back
        self._ending: set[str] = set()  # ranks that have ended, their instances held until their container is empty
        self._users: dict[tuple[int, int, int], set[str]] = {}  # (gpu, start, size) -> rank keys
        self._created: list[dict] = list(created or [])
        self._on_change = on_change  # called with the new record list whenever it changes (the agent's state)

    @property
    def created(self) -> list[dict]:
        return self._created

    @created.setter
    def created(self, records: list[dict]) -> None:
        self._created = records
        if self._on_change is not None:
            self._on_change(records)

    def mig_gpus(self) -> list[int]:
        return sorted(g for g, (name, mem) in self.gpus.items() if mig_family(name, mem))

    def users(self, gpu: int, start: int, size: int) -> set[str]:
        with self._lock:
            return set(self._users.get((gpu, start, size), ()))

    def _record(self, key: tuple[int, int, int]) -> dict | None:
        return next((r for r in self.created if _placement(r) == key), None)

    def owns(self, inst: MigInstance) -> bool:
        """Whether this agent created `inst` (same placement and GPU instance id as its record)."""
        rec = self._record(inst.key)
        return rec is not None and int(rec.get("gi_id", -1)) == inst.gi_id

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
                raise MigError(
                    f"GPU {gpu} ({name}, {family}) has no MIG profile {s['profile']!r}; "
                    f"its profiles: {', '.join(family_table(family))}"
                )
            if size and size != prof.size:
                raise MigError(f"MIG profile {prof.name} takes {prof.size} memory slices, not {size}")
            slices_total = family_slices(family)[1]
            if start not in prof.starts or start < 0 or start + prof.size > slices_total:
                raise MigError(
                    f"MIG profile {prof.name} cannot start at memory slice {start} "
                    f"(valid starts {','.join(map(str, prof.starts))})"
                )
            out.append(prof)
        return out

    def acquire(
        self, rank: str, slices: list[dict], busy_gpus: dict[int, str] | None = None, wait_s: float = 0.0
    ) -> list[dict]:
        """Find or create the instances of `slices` for rank `rank`: the slices back, each with its MIG device
        `uuid`, `gi_id`, `ci_id` and whether this agent `created` it. `busy_gpus` maps GPUs that whole-GPU or
        fractional ranks of this agent use to one such rank: their geometry is not changed. On failure every
        instance made for this call is destroyed again and nothing stays acquired.

        An instance (or one overlapping a slice) still held by an ENDED rank of another attempt (`mark_ending`) is
        never handed over: the agent gives an ended attempt's instances back only once its container is empty, so
        this waits up to `wait_s` for that, then raises MigError. (Instances of live ranks: as before, see
        _acquire_one; ranks of one attempt ("job/attempt/rank" keys) may share one.)"""
        busy_gpus = busy_gpus or {}
        deadline = time.monotonic() + wait_s
        with self._lock:
            while (holder := self._other_attempt(rank, slices)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MigError(
                        f"MIG slices {holder[0]} are still held by rank {holder[1]} of another attempt, whose "
                        f"processes have not all exited (waited {wait_s:g}s)"
                    )
                self._released.wait(left)
            profiles = self.validate(slices)
            done: list[dict] = []
            try:
                for s, prof in zip(slices, profiles, strict=True):
                    done.append(self._acquire_one(rank, int(s["gpu"]), prof, int(s["start"]), busy_gpus))
            except Exception:
                self.release(rank, done)
                raise
            return done

    def mark_ending(self, rank: str) -> None:
        """Rank `rank` has ended but its instances stay its own until `release` (its container is not empty yet)."""
        with self._lock:
            self._ending.add(rank)

    def _other_attempt(self, rank: str, slices: list[dict]) -> tuple[str, str] | None:
        """(placement, rank) of a user of another attempt than `rank`'s whose instance overlaps one of `slices`."""
        attempt = rank.rsplit("/", 1)[0]
        for s in slices:
            gpu, start = int(s["gpu"]), int(s["start"])
            size = int(s.get("size") or 0) or 1
            mask = placement_mask(start, size)
            for (g, st, sz), users in self._users.items():
                if g != gpu or not placement_mask(st, sz) & mask:
                    continue
                other = sorted(u for u in users if u in self._ending and u.rsplit("/", 1)[0] != attempt)
                if other:
                    return f"GPU {g} {st}-{st + sz - 1}", other[0]
        return None

    def _acquire_one(self, rank: str, gpu: int, prof: MigProfile, start: int, busy: dict[int, str]) -> dict:
        key = (gpu, start, prof.size)
        mask = prof.slice_mask(start)
        existing = self.backend.list_instances(gpu)
        exact = next((i for i in existing if (i.start, i.size, i.profile) == (start, prof.size, prof.name)), None)
        if exact is not None and not self.owns(exact):
            raise MigError(
                f"{prof.name} at slices {start}-{start + prof.size - 1} of GPU {gpu} is MIG instance "
                f"{exact.gi_id}, which this agent did not create (occupied by someone else)"
            )
        if exact is None:
            if gpu in busy:
                raise MigError(
                    f"GPU {gpu} is in use by rank {busy[gpu]} (whole GPU or fractional share): its MIG "
                    "geometry cannot change while a rank uses it"
                )
            overlapping = [i for i in existing if i.mask & mask]
            for inst in overlapping:
                if not self.owns(inst):
                    raise MigError(
                        f"{prof.name} at slices {start}-{start + prof.size - 1} of GPU {gpu} overlaps "
                        f"MIG instance {inst.profile} at {inst.start}-{inst.start + inst.size - 1}, "
                        "which this agent did not create (occupied by someone else)"
                    )
                users = self._users.get(inst.key)
                if users:
                    raise MigError(
                        f"{prof.name} at slices {start}-{start + prof.size - 1} of GPU {gpu} overlaps "
                        f"MIG instance {inst.profile} at {inst.start}-{inst.start + inst.size - 1}, "
                        f"in use by rank {sorted(users)[0]}"
                    )
            for inst in overlapping:  # ours, and no rank uses it: reconfigure
                log.info(
                    "mig_reconfigure",
                    gpu=gpu,
                    destroy=inst.profile,
                    start=inst.start,
                    wanted=prof.name,
                    wanted_start=start,
                )
                self._destroy(inst)
            made = self.backend.create_instance(gpu, prof.name, start)
            self.created = [
                *self.created,
                {
                    "gpu": gpu,
                    "profile": made.profile,
                    "start": made.start,
                    "size": made.size,
                    "gi_id": made.gi_id,
                    "ci_id": made.ci_id,
                    "uuid": made.uuid,
                },
            ]
            inst = made
        else:
            inst = exact
            if self._users.get(key):
                log.warning(
                    "mig_instance_shared",
                    gpu=gpu,
                    profile=prof.name,
                    start=start,
                    rank=rank,
                    users=sorted(self._users[key]),
                )
        if not inst.uuid:
            raise MigError(f"MIG instance {prof.name} at slice {start} of GPU {gpu} has no compute instance")
        self._users.setdefault(key, set()).add(rank)
        return {
            "gpu": gpu,
            "profile": prof.name,
            "start": start,
            "size": prof.size,
            "uuid": inst.uuid,
            "gi_id": inst.gi_id,
            "ci_id": inst.ci_id,
            "created": True,
        }

    def _destroy(self, inst: MigInstance | dict) -> None:
        if isinstance(inst, dict):
            gpu, start, size = _placement(inst)
            gi_id = int(inst.get("gi_id", -1))
        else:
            gpu, start, size, gi_id = inst.gpu, inst.start, inst.size, inst.gi_id
        self.backend.destroy_instance(gpu, start, size, gi_id)
        self.created = [r for r in self.created if _placement(r) != (gpu, start, size)]

    def adopt(self, rank: str, slices: list[dict]) -> None:
        """A rank a restarted agent adopted uses these instances (nothing is created or destroyed)."""
        with self._lock:
            for s in slices:
                self._users.setdefault(_placement(s), set()).add(rank)

    def release(self, rank: str, slices: list[dict]) -> list[tuple[int, int, int]]:
        """Rank `rank` no longer uses `slices`: destroy each instance this agent created that no other rank uses.
        Returns the placements destroyed; failures are logged, never raised."""
        destroyed = []
        with self._lock:
            self._released.notify_all()  # (sent when the lock is let go) a waiting acquire looks again
            self._ending.discard(rank)
            for s in slices:
                key = _placement(s)
                users = self._users.get(key)
                if users is not None:
                    users.discard(rank)
                    if users:
                        continue
                    del self._users[key]
                rec = self._record(key)
                if rec is None:
                    continue  # not ours: never destroyed
                try:
                    self._destroy(rec)
                    destroyed.append(key)
                except Exception as exc:  # a leftover of ours is cleaned up at the next start
                    log.warning("mig_release_failed", gpu=key[0], start=key[1], size=key[2], rank=rank, error=str(exc))
        return destroyed

    def clean_up(self) -> list[tuple[int, int, int]]:
        """At start: destroy the instances this agent created that no adopted rank uses; forget the records of
        instances that are gone. Failures are logged."""
        destroyed = []
        with self._lock:
            for rec in list(self.created):
                key = _placement(rec)
                if self._users.get(key):
                    continue
                try:
                    present = any(
                        i.key == key and i.gi_id == int(rec.get("gi_id", -1))
                        for i in self.backend.list_instances(key[0])
                    )
                    if present:
                        self._destroy(rec)
                        destroyed.append(key)
                    else:
                        self.created = [r for r in self.created if _placement(r) != key]
                except MigError as exc:
                    log.warning("mig_cleanup_failed", gpu=key[0], start=key[1], size=key[2], error=str(exc))
        return destroyed

    def switch_mode(self, gpu: int, enable: bool, busy_gpus: dict[int, str]) -> tuple[int, int]:
        """Switch an idle GPU's MIG mode (--mig-manage): (current, pending) after it. Refused (MigError) while a
        rank of this agent uses the GPU or an instance this agent did not create is on it; the instances it made
        that no rank uses are destroyed first."""
        with self._lock:
            if gpu not in self.gpus or not mig_family(*self.gpus[gpu]):
                raise MigError(f"GPU {gpu} does not support MIG")
            if gpu in busy_gpus:
                raise MigError(f"GPU {gpu} is in use by rank {busy_gpus[gpu]}: its MIG mode cannot change")
            users = sorted(r for (g, _, _), ranks in self._users.items() if g == gpu for r in ranks)
            if users:
                raise MigError(f"GPU {gpu} is in use by rank {users[0]}: its MIG mode cannot change")
            current, pending = self.backend.mode(gpu)
            want = int(enable)
            if current == want and pending == want:
                return current, pending
            if current == want:  # the other mode is pending (waits for a reset): ask for this one, cancelling it
                return self.backend.set_mode(gpu, enable)
            if current == 1:
                for inst in self.backend.list_instances(gpu):
                    if not self.owns(inst):
                        raise MigError(
                            f"GPU {gpu} holds MIG instance {inst.profile} at {inst.start}, which this "
                            "agent did not create: its MIG mode is left on"
                        )
                    self._destroy(inst)
            after = self.backend.set_mode(gpu, enable)
            log.info(
                "mig_mode_switched" if after[0] == want else "mig_mode_pending",
                gpu=gpu,
                enable=enable,
                current=after[0],
                pending=after[1],
            )
            return after

    def describe(self) -> dict[int, list[tuple[MigInstance, bool]]]:
        """(instance, created by this agent) on each MIG-mode GPU; GPUs whose instances cannot be read are left
        out."""
        out = {}
        with self._lock:
            for gpu in self.mig_gpus():
                try:
                    out[gpu] = [(i, self.owns(i)) for i in self.backend.list_instances(gpu)]
                except MigError:
                    continue
        return out
