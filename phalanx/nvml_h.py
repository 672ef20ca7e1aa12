"""nvml.h's structure layouts, as ctypes structures: what the NVML C library reads and writes at each offset.

Bindings have their own copies, which have drifted from the header (nvidia-ml-py 12.x declared the GPU fabric
UUID as char[80], not unsigned char[16]); code that needs the layout itself (the fabric query in the node agent's
discovery, the simulated NVML library in phalanx.simhost.nvml) uses these. tests/unit/test_nvml_bindings.py holds the
installed binding's structures against them.
"""

from __future__ import annotations

import ctypes as C


def struct_version(struct: type[C.Structure], version: int) -> int:
    """NVML_STRUCT_VERSION(data, ver): sizeof(struct) | ver << 24."""
    return C.sizeof(struct) | (version << 24)


class nvmlMemory_t(C.Structure):
    _fields_ = [("total", C.c_ulonglong), ("free", C.c_ulonglong), ("used", C.c_ulonglong)]


class nvmlMemory_v2_t(C.Structure):
    _fields_ = [
        ("version", C.c_uint),
        ("total", C.c_ulonglong),
        ("reserved", C.c_ulonglong),
        ("free", C.c_ulonglong),
        ("used", C.c_ulonglong),
    ]


class nvmlPciInfo_t(C.Structure):
    _fields_ = [
        ("busIdLegacy", C.c_char * 16),
        ("domain", C.c_uint),
        ("bus", C.c_uint),
        ("device", C.c_uint),
        ("pciDeviceId", C.c_uint),
        ("pciSubSystemId", C.c_uint),
        ("busId", C.c_char * 32),
    ]


class nvmlGpuFabricInfo_t(C.Structure):
    _fields_ = [("clusterUuid", C.c_ubyte * 16), ("status", C.c_int), ("cliqueId", C.c_uint), ("state", C.c_ubyte)]


class nvmlGpuFabricInfo_v2_t(C.Structure):
    _fields_ = [
        ("version", C.c_uint),
        ("clusterUuid", C.c_ubyte * 16),
        ("status", C.c_int),
        ("cliqueId", C.c_uint),
        ("state", C.c_ubyte),
        ("healthMask", C.c_uint),
    ]


class nvmlGpuFabricInfo_v3_t(C.Structure):
    _fields_ = [
        ("version", C.c_uint),
        ("clusterUuid", C.c_ubyte * 16),
        ("status", C.c_int),
        ("cliqueId", C.c_uint),
        ("state", C.c_ubyte),
        ("healthMask", C.c_uint),
        ("healthSummary", C.c_ubyte),
    ]


class nvmlGpuInstancePlacement_t(C.Structure):
    _fields_ = [("start", C.c_uint), ("size", C.c_uint)]


_GI_PROFILE_COMMON = [
    ("id", C.c_uint),
    ("isP2pSupported", C.c_uint),
    ("sliceCount", C.c_uint),
    ("instanceCount", C.c_uint),
    ("multiprocessorCount", C.c_uint),
    ("copyEngineCount", C.c_uint),
    ("decoderCount", C.c_uint),
    ("encoderCount", C.c_uint),
    ("jpegCount", C.c_uint),
    ("ofaCount", C.c_uint),
    ("memorySizeMB", C.c_ulonglong),
]


class nvmlGpuInstanceProfileInfo_t(C.Structure):
    _fields_ = _GI_PROFILE_COMMON


class nvmlGpuInstanceProfileInfo_v2_t(C.Structure):
    _fields_ = [("version", C.c_uint), *_GI_PROFILE_COMMON, ("name", C.c_char * 96)]


class nvmlGpuInstanceInfo_t(C.Structure):
    _fields_ = [
        ("device", C.c_void_p),
        ("id", C.c_uint),
        ("profileId", C.c_uint),
        ("placement", nvmlGpuInstancePlacement_t),
    ]


_CI_PROFILE_COMMON = [
    ("id", C.c_uint),
    ("sliceCount", C.c_uint),
    ("instanceCount", C.c_uint),
    ("multiprocessorCount", C.c_uint),
    ("sharedCopyEngineCount", C.c_uint),
    ("sharedDecoderCount", C.c_uint),
    ("sharedEncoderCount", C.c_uint),
    ("sharedJpegCount", C.c_uint),
    ("sharedOfaCount", C.c_uint),
]


class nvmlComputeInstanceProfileInfo_t(C.Structure):
    _fields_ = _CI_PROFILE_COMMON


class nvmlComputeInstanceProfileInfo_v2_t(C.Structure):
    _fields_ = [("version", C.c_uint), *_CI_PROFILE_COMMON, ("name", C.c_char * 96)]


class nvmlComputeInstancePlacement_t(C.Structure):
    _fields_ = [("start", C.c_uint), ("size", C.c_uint)]


class nvmlComputeInstanceInfo_t(C.Structure):
    _fields_ = [
        ("device", C.c_void_p),
        ("gpuInstance", C.c_void_p),
        ("id", C.c_uint),
        ("profileId", C.c_uint),
        ("placement", nvmlComputeInstancePlacement_t),
    ]


class nvmlEventData_t(C.Structure):
    _fields_ = [
        ("device", C.c_void_p),
        ("eventType", C.c_ulonglong),
        ("eventData", C.c_ulonglong),
        ("gpuInstanceId", C.c_uint),
        ("computeInstanceId", C.c_uint),
    ]


NVML_H_STRUCTS = {  # nvml.h name -> layout, for the tests that hold bindings against the header
    "nvmlMemory_t": nvmlMemory_t,
    "nvmlMemory_v2_t": nvmlMemory_v2_t,
    "nvmlPciInfo_t": nvmlPciInfo_t,
    "nvmlGpuFabricInfo_t": nvmlGpuFabricInfo_t,
    "nvmlGpuFabricInfo_v2_t": nvmlGpuFabricInfo_v2_t,
    "nvmlGpuInstancePlacement_t": nvmlGpuInstancePlacement_t,
    "nvmlGpuInstanceProfileInfo_t": nvmlGpuInstanceProfileInfo_t,
    "nvmlGpuInstanceProfileInfo_v2_t": nvmlGpuInstanceProfileInfo_v2_t,
    "nvmlGpuInstanceInfo_t": nvmlGpuInstanceInfo_t,
    "nvmlComputeInstanceProfileInfo_t": nvmlComputeInstanceProfileInfo_t,
    "nvmlComputeInstanceProfileInfo_v2_t": nvmlComputeInstanceProfileInfo_v2_t,
    "nvmlComputeInstanceInfo_t": nvmlComputeInstanceInfo_t,
    "nvmlEventData_t": nvmlEventData_t,
}
GI_PROFILE_INFO_V2 = struct_version(nvmlGpuInstanceProfileInfo_v2_t, 2)
CI_PROFILE_INFO_V2 = struct_version(nvmlComputeInstanceProfileInfo_v2_t, 2)
MEMORY_V2 = struct_version(nvmlMemory_v2_t, 2)
FABRIC_INFO_V2 = struct_version(nvmlGpuFabricInfo_v2_t, 2)
FABRIC_INFO_V3 = struct_version(nvmlGpuFabricInfo_v3_t, 3)
