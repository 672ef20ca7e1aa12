"""The simulated C functions of init and the system, device enumeration and properties, NVLink and the GPU
fabric."""

from __future__ import annotations

import ctypes as C
import uuid as uuidlib

from phalanx.nvml_h import (  # nvml.h's layouts, shared with the agent's discovery
    FABRIC_INFO_V2,
    FABRIC_INFO_V3,
    MEMORY_V2,
    nvmlGpuFabricInfo_t,
    nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t,
    nvmlMemory_t,
    nvmlMemory_v2_t,
    nvmlPciInfo_t,
)

from .base import NvmlBase
from .cabi import P, U, _c_function
from .codes import (
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
    NVML_SUCCESS,
    NVML_TOPOLOGY_INTERNAL,
)
from .host import SimFabric


class DeviceFunctions(NvmlBase):
    """Init, system, devices, NVLink and fabric."""

    # ---------------------------------------------------------------- init and system

    @_c_function(U)
    def nvmlInitWithFlags(self, flags):
        if self._host.init_error is not None:
            return self._host.init_error
        self._refcount += 1

    @_c_function()
    def nvmlShutdown(self):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        self._refcount -= 1

    @_c_function(U)
    def nvmlErrorString(self, result):
        return C.addressof(self._error_strings.get(result, self._error_strings[NVML_ERROR_UNKNOWN]))

    @_c_function(P, U)
    def nvmlSystemGetDriverVersion(self, buf, length):
        return self._ready() or self._put_string(buf, length, self._host.driver_version)

    @_c_function(P, U)
    def nvmlSystemGetNVMLVersion(self, buf, length):
        return self._ready() or self._put_string(buf, length, f"12.{self._host.driver_version}")

    @_c_function(P)
    def nvmlSystemGetCudaDriverVersion(self, out):
        return self._ready() or self._put(out, C.c_int, self._host.cuda_version)

    @_c_function(P)
    def nvmlSystemGetCudaDriverVersion_v2(self, out):
        return self._ready() or self._put(out, C.c_int, self._host.cuda_version)

    # ---------------------------------------------------------------- devices

    @_c_function(P)
    def nvmlDeviceGetCount_v2(self, out):
        return self._ready() or self._put(out, C.c_uint, len(self._host.gpus))

    @_c_function(U, P)
    def nvmlDeviceGetHandleByIndex_v2(self, index, out):
        if self._refcount <= 0:
            return NVML_ERROR_UNINITIALIZED
        if not 0 <= index < len(self._host.gpus):
            return NVML_ERROR_INVALID_ARGUMENT
        return self._put(out, C.c_void_p, self._handle(("gpu", index)))

    @_c_function(P, P, U)
    def nvmlDeviceGetUUID(self, handle, buf, length):
        key = self._key(handle)
        if key is not None and key[0] == "mig" and self._refcount > 0:
            return self._put_string(buf, length, self._host.mig_device_uuid(key[1], key[2], key[3]))
        gpu, err = self._device(handle)
        return err or self._put_string(buf, length, gpu.uuid)

    @_c_function(P, P, U)
    def nvmlDeviceGetName(self, handle, buf, length):
        gpu, err = self._device(handle)
        return err or self._put_string(buf, length, gpu.name)

    @_c_function(P, P)
    def nvmlDeviceGetMemoryInfo(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        mem = self._struct(out, nvmlMemory_t)
        mem.total = gpu.memory_mib * 1024 * 1024
        mem.free, mem.used = mem.total, 0

    @_c_function(P, P)
    def nvmlDeviceGetMemoryInfo_v2(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        mem = self._struct(out, nvmlMemory_v2_t)
        if mem.version != MEMORY_V2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        mem.total = gpu.memory_mib * 1024 * 1024
        mem.reserved = 0
        mem.free, mem.used = mem.total, 0

    @staticmethod
    def _fill_pci(out, bus_id: str) -> int:
        if not out:
            return NVML_ERROR_INVALID_ARGUMENT
        domain, bus, devfn = bus_id.split(":")
        dev, fn = devfn.split(".")
        pci = nvmlPciInfo_t.from_address(out)
        pci.busId = bus_id.encode()
        pci.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{devfn}".encode()
        pci.domain, pci.bus, pci.device = int(domain, 16), int(bus, 16), int(dev, 16)
        pci.pciDeviceId, pci.pciSubSystemId = 0x233010DE, 0x16C110DE
        del fn
        return NVML_SUCCESS

    @_c_function(P, P)
    def nvmlDeviceGetPciInfo_v3(self, handle, out):
        gpu, err = self._device(handle)
        return err or self._fill_pci(out, gpu.bus_id)

    @_c_function(P, P)
    def nvmlDeviceGetMinorNumber(self, handle, out):
        gpu, err = self._device(handle)
        if err:
            return err
        return self._put(out, C.c_uint, gpu.index)  # /dev/nvidia<index>, as on hosts whose GPUs enumerate in order

    @_c_function(P, P, P)
    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        gpu, err = self._device(handle)
        if err:
            return err
        if gpu.compute_capability == (0, 0):
            return NVML_ERROR_NOT_SUPPORTED
        return self._put(major, C.c_int, gpu.compute_capability[0]) or self._put(
            minor, C.c_int, gpu.compute_capability[1]
        )

    @_c_function(P, P)
    def nvmlDeviceGetNumaNodeId(self, handle, out):
        gpu, err = self._device(handle)
        if err:
            return err
        if gpu.gpu_numa_id < 0:
            return NVML_ERROR_NOT_SUPPORTED
        return self._put(out, C.c_uint, gpu.gpu_numa_id)

    @_c_function(P, P, P)
    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2, out):
        a, err = self._device(h1)
        b, err2 = self._device(h2)
        if err or err2:
            return err or err2
        level = (
            NVML_TOPOLOGY_INTERNAL
            if a is b
            else self._host.ancestors[(self._host.gpus.index(a), self._host.gpus.index(b))]
        )
        return self._put(out, C.c_int, level)

    # ---------------------------------------------------------------- NVLink

    def _link(self, handle, link):
        gpu, err = self._device(handle)
        if err:
            return None, err
        if gpu.links is None:
            return None, NVML_ERROR_NOT_SUPPORTED
        if not 0 <= link < len(gpu.links):
            return None, NVML_ERROR_INVALID_ARGUMENT
        return gpu.links[link], NVML_SUCCESS

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkState(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._put(out, C.c_int, info[0])

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._fill_pci(out, info[1])

    @_c_function(P, U, P)
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link, out):
        info, err = self._link(handle, link)
        return err or self._put(out, C.c_int, info[2])

    # ---------------------------------------------------------------- fabric

    def _fill_fabric(self, info, fabric: SimFabric) -> None:
        info.clusterUuid[:] = list(uuidlib.UUID(fabric.cluster_uuid).bytes)
        info.status, info.cliqueId, info.state = fabric.status, fabric.clique, fabric.state

    @_c_function(P, P)
    def nvmlDeviceGetGpuFabricInfo(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        if self._host.fabric is None:
            return NVML_ERROR_NOT_SUPPORTED
        self._fill_fabric(self._struct(out, nvmlGpuFabricInfo_t), self._host.fabric)

    @_c_function(P, P)
    def nvmlDeviceGetGpuFabricInfoV(self, handle, out):
        gpu, err = self._device(handle)
        if err or not out:
            return err or NVML_ERROR_INVALID_ARGUMENT
        version = C.c_uint.from_address(out).value
        if version not in (FABRIC_INFO_V2, FABRIC_INFO_V3):
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if self._host.fabric is None:
            return NVML_ERROR_NOT_SUPPORTED
        struct = nvmlGpuFabricInfo_v3_t if version == FABRIC_INFO_V3 else nvmlGpuFabricInfo_v2_t
        info = self._struct(out, struct)
        self._fill_fabric(info, self._host.fabric)
        info.healthMask = 0
