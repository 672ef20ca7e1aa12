"""The library object the real bindings load (`SimulatedNvmlLibrary`, in place of libnvidia-ml.so.1) and the
binder: `bind(host)` gives a private instance of the installed pynvml over it."""

from __future__ import annotations

import ctypes as C
import importlib.util
import itertools
import sys
from typing import Any

from .cabi import _prototype
from .codes import NVML_ERROR_UNKNOWN, NVML_SUCCESS
from .functions import NvmlFunctions
from .host import SimulatedHost


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


def load_bindings(name: str = "") -> Any:
    """A private instance of the installed nvidia-ml-py `pynvml` module: the same file, its own globals."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise ImportError("nvidia-ml-py (pynvml) is not installed")
    private = importlib.util.spec_from_file_location(name or f"pynvml_simulated_{next(_counter)}", spec.origin)
    if private is None or private.loader is None:  # a .py file always has a spec and a loader
        raise ImportError(f"cannot load pynvml from {spec.origin}")
    module = importlib.util.module_from_spec(private)
    sys.modules[private.name] = module  # the binding looks itself up there while it is imported
    try:
        private.loader.exec_module(module)
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
