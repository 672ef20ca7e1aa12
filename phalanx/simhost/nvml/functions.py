"""All the simulated C functions (`NvmlFunctions`), by concern in their own modules, and their table."""

from __future__ import annotations

from .devices import DeviceFunctions
from .health import HealthFunctions
from .mig import MigFunctions


class NvmlFunctions(DeviceFunctions, MigFunctions, HealthFunctions):
    """The C functions of the simulated library, over one SimulatedHost."""


def c_functions() -> dict[str, tuple]:
    """Every C function the simulated library has, with its nvml.h parameter types."""
    out: dict[str, tuple] = {}
    for cls in NvmlFunctions.__mro__:
        for name, fn in vars(cls).items():
            if hasattr(fn, "c_argtypes") and name not in out:
                out[name] = fn.c_argtypes
    return out
