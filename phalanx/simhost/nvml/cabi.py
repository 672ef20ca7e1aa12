"""The C ABI shim: how a Python method becomes a C entry point of the simulated library: `_c_function` marks it
with nvml.h's parameter types, `U`/`ULL` accept what a C compiler would pass for an integer, and `_prototype`
makes the ctypes function type (arity checked, as a C call would not be)."""

from __future__ import annotations

import ctypes as C
from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr, the base of every C function type


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
    return type("NvmlCFunction", (CFuncPtr,), {"_argtypes_": argtypes, "_restype_": restype, "_flags_": 0})
