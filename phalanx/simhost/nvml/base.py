"""The common part of the simulated C functions (`NvmlBase`): handles, init state and result writers."""

from __future__ import annotations

import ctypes as C
from typing import Any

from .codes import (
    _ERROR_BUFFERS,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_UNINITIALIZED,
    NVML_SUCCESS,
)
from .host import SimGpu, SimulatedHost


class NvmlBase:
    """The state and plumbing the C functions share: the reference count, the handles (addresses of cells this
    object keeps) and the writers of results into the caller's memory."""

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
