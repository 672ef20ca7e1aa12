"""nvml.h's return codes and enum values that the simulated library answers with, and its error strings."""

from __future__ import annotations

import ctypes as C

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
