"""The simulated C functions of health: XID event sets, ECC counters and clocks event (throttle) reasons."""

from __future__ import annotations

import ctypes as C

from phalanx.nvml_h import (  # nvml.h's layouts, shared with the agent's discovery
    nvmlEventData_t,
)

from .base import NvmlBase
from .cabi import ULL, P, U, _c_function
from .codes import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)


class HealthFunctions(NvmlBase):
    """Event sets, ECC counters, clocks event reasons."""

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
