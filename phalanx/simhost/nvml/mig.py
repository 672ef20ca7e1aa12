"""The simulated C functions of MIG: mode, GPU and compute instance profiles, placements, creation and
destruction, MIG device handles."""

from __future__ import annotations

import ctypes as C
import itertools

from phalanx.core import mig as migcore
from phalanx.nvml_h import (  # nvml.h's layouts, shared with the agent's discovery
    CI_PROFILE_INFO_V2,
    GI_PROFILE_INFO_V2,
    nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t,
    nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t,
)

from .base import NvmlBase
from .cabi import P, U, _c_function
from .codes import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_UNINITIALIZED,
    NVML_SUCCESS,
)
from .host import CI_SLICES, SimComputeInstance, SimGpu, SimGpuInstance, _max_count


class MigFunctions(NvmlBase):
    """MIG mode, instances and their devices."""

    # ---------------------------------------------------------------- MIG

    def _mig_gpu(self, handle) -> tuple[SimGpu | None, int]:
        gpu, err = self._device(handle)
        if gpu is None:  # err says why
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
        if gpu is None:
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
        if gpu is None:
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
