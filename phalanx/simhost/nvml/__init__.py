"""A simulated NVML C library under the real nvidia-ml-py bindings.

`bind(host)` returns a private instance of the installed `pynvml` module (the real binding code, loaded afresh so
its globals are its own) whose library is a `SimulatedNvmlLibrary` instead of `libnvidia-ml.so.1`. Only two things
are replaced: the library loading (`pynvml.nvmlLib` is set before the first call, so `_LoadNvmlLibrary` never opens
the shared object) and the function-pointer lookup (the binding's own `getattr(nvmlLib, name)` finds ctypes
function pointers here). Every call therefore goes through the binding's real code: its argument marshalling, its
ctypes structures and its return-code checks. A binding called with the wrong arity fails in the binding; a binding
whose structure disagrees with nvml.h reads what the C library wrote at nvml.h's offsets, as on a real host.

    host = SimulatedHost.from_dump(dump, gpu_model="NVIDIA H100 80GB HBM3", memory_mib=81559, node_name="n1")
    nv = bind(host)
    nv.nvmlInit(); nv.nvmlDeviceGetCount()   # -> 8, answered by SimulatedHost

What the C functions implement (nvml.h signatures; pointers arrive as addresses and are filled at nvml.h's layout,
the structures below):
- init/shutdown (reference counted; every device call before init is NVML_ERROR_UNINITIALIZED), error strings,
  driver, NVML and CUDA versions;
- device enumeration: count, handles by index, UUID, name, memory (v1 and v2 structs), PCI info (v3), compute
  capability, NUMA node id (Grace GPUs only), common ancestor (NVML_TOPOLOGY_* from the dump's PCIe words; NODE or
  SYSTEM for an NVLink pair by NUMA node);
- NVLink: per-link state, remote PCI info (v2) and remote device type. A GPU whose NV peers add up to more links
  than one GPU has (an NVSwitch baseboard, a GB200 tray) has N links into NVSwitches (N: its largest NV# cell); a
  GPU whose NV cells fit (hybrid cube mesh, NV4 pairs) has direct links to each peer; on an NVSwitch box a GPU with
  no NV cell has its links disabled; a GPU without NVLink answers NVML_ERROR_NOT_SUPPORTED;
- the GPU fabric (multi-node NVLink, GB200 NVL72): `nvmlDeviceGetGpuFabricInfo` (v1 struct) and
  `nvmlDeviceGetGpuFabricInfoV` (v2/v3, version checked as NVML does: NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
- MIG: mode (get/set; disabling with instances is NVML_ERROR_IN_USE), GPU instance profiles (v1 and V structs,
  from phalanx.core.mig's tables with their NVML profile ids), possible placements, creation with and without a
  placement (NVIDIA's placement rules, compute-slice budget, one media-extension instance per GPU), compute
  instance profiles and instances, MIG device handles and their ids and UUIDs, destruction (a GPU instance with
  compute instances is NVML_ERROR_IN_USE). The MIG state can live in a file, so it survives an agent restart the
  way a real GPU's instances do;
- health: event sets with XID critical errors (`inject_xid`), volatile and aggregate ECC counters, clocks event
  (throttle) reasons.

Failure injection for tests: `host.fail[c_name] = NVML_ERROR_*` makes that C function return the code;
`host.missing.add(c_name)` removes it from the library (the binding then raises NVMLError_FunctionNotFound, as
with an older driver). Any exception inside a C function is recorded in `host.errors` and answered
NVML_ERROR_UNKNOWN (a C library cannot raise), so tests can assert it stays empty.
"""

from __future__ import annotations

from phalanx.nvml_h import (
    CI_PROFILE_INFO_V2,
    FABRIC_INFO_V2,
    FABRIC_INFO_V3,
    GI_PROFILE_INFO_V2,
    MEMORY_V2,
    nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t,
    nvmlComputeInstanceProfileInfo_v2_t,
    nvmlEventData_t,
    nvmlGpuFabricInfo_t,
    nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t,
    nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t,
    nvmlMemory_t,
    nvmlMemory_v2_t,
    nvmlPciInfo_t,
)

from .binder import SimulatedNvmlLibrary, bind, load_bindings, unbind
from .cabi import ULL, P, U
from .codes import (
    MAX_LINKS_PER_GPU,
    NVML_AGGREGATE_ECC,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    NVML_GPU_FABRIC_STATE_NOT_STARTED,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NVLINK_DEVICE_TYPE_GPU,
    NVML_NVLINK_DEVICE_TYPE_IBMNPU,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
    NVML_SUCCESS,
    NVML_TOPOLOGY_INTERNAL,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SYSTEM,
    NVML_VOLATILE_ECC,
)
from .functions import NvmlFunctions, c_functions
from .host import CI_SLICES, SimComputeInstance, SimFabric, SimGpu, SimGpuInstance, SimulatedHost, model_traits

# The package is split by concern: codes (nvml.h's return codes), host (the simulated hardware), cabi (the C ABI
# shim), base, devices, mig and health (the C functions, composed in functions), binder (the library object and
# bind). Every name the single module had is still here, nvml.h's structures included.
__all__ = [
    "CI_PROFILE_INFO_V2",
    "CI_SLICES",
    "FABRIC_INFO_V2",
    "FABRIC_INFO_V3",
    "GI_PROFILE_INFO_V2",
    "MAX_LINKS_PER_GPU",
    "MEMORY_V2",
    "NVML_AGGREGATE_ECC",
    "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_INSUFFICIENT_RESOURCES",
    "NVML_ERROR_INSUFFICIENT_SIZE",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_IN_USE",
    "NVML_ERROR_LIBRARY_NOT_FOUND",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_RESET_REQUIRED",
    "NVML_ERROR_TIMEOUT",
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_UNKNOWN",
    "NVML_EVENT_TYPE_XID_CRITICAL_ERROR",
    "NVML_FEATURE_DISABLED",
    "NVML_FEATURE_ENABLED",
    "NVML_GPU_FABRIC_STATE_COMPLETED",
    "NVML_GPU_FABRIC_STATE_IN_PROGRESS",
    "NVML_GPU_FABRIC_STATE_NOT_STARTED",
    "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_NVLINK_DEVICE_TYPE_GPU",
    "NVML_NVLINK_DEVICE_TYPE_IBMNPU",
    "NVML_NVLINK_DEVICE_TYPE_SWITCH",
    "NVML_SUCCESS",
    "NVML_TOPOLOGY_INTERNAL",
    "NVML_TOPOLOGY_NODE",
    "NVML_TOPOLOGY_SYSTEM",
    "NVML_VOLATILE_ECC",
    "NvmlFunctions",
    "P",
    "SimComputeInstance",
    "SimFabric",
    "SimGpu",
    "SimGpuInstance",
    "SimulatedHost",
    "SimulatedNvmlLibrary",
    "U",
    "ULL",
    "bind",
    "c_functions",
    "load_bindings",
    "model_traits",
    "nvmlComputeInstanceInfo_t",
    "nvmlComputeInstanceProfileInfo_t",
    "nvmlComputeInstanceProfileInfo_v2_t",
    "nvmlEventData_t",
    "nvmlGpuFabricInfo_t",
    "nvmlGpuFabricInfo_v2_t",
    "nvmlGpuFabricInfo_v3_t",
    "nvmlGpuInstanceInfo_t",
    "nvmlGpuInstancePlacement_t",
    "nvmlGpuInstanceProfileInfo_t",
    "nvmlGpuInstanceProfileInfo_v2_t",
    "nvmlMemory_t",
    "nvmlMemory_v2_t",
    "nvmlPciInfo_t",
    "unbind",
]
