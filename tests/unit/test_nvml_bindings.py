"""The simulated NVML library under the real nvidia-ml-py bindings, and the agent's NVML calls held against them.

- every C function of phalanx.simhost.nvml is reached through a pynvml wrapper and answers what the host holds;
- the library's nvml.h structures agree with the installed binding's (sizes and field offsets);
- every `nvmlXxx(...)` call in the agent's sources has a signature the installed pynvml has (statically), and every
  call discovery, MIG and health make at run time binds to the binding's signature;
- an optional probe that fails leaves its fact unknown and logs one warning; the core enumeration is fatal;
- fabric domains only from COMPLETED with status success;
- the oldest nvidia-ml-py of the pinned range runs the same scenario to the same result (tests/helpers/nvml_scenario.py).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from helpers.required import need
from structlog.testing import capture_logs

from phalanx import nvml_h
from phalanx.api.v1 import agent_pb2
from phalanx.profiles import load_profile
from phalanx.simhost import nvml as sim
from phalanx.simhost.nvml import SimulatedHost, bind, c_functions
from phalanx.simhost.sysfs import build_fake_sysfs
from services.node_agent.discovery import DiscoveryError, discover_topology
from services.node_agent.health import HealthMonitor, NvmlHealthSource
from services.node_agent.mig_manager import MigManager, NvmlMigBackend
from services.node_agent.simulated import simulated_topology

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def host_of(profile: str = "dgx-h100", **kw) -> SimulatedHost:
    prof = load_profile(profile)
    return SimulatedHost.from_dump(prof.dump, gpu_model=prof.gpu_model, memory_mib=prof.memory_mib, **kw)


# ------------------------------------------------------------------------------------------------ every C function


def test_every_c_function_is_exercised_through_pynvml():
    """Each C function is called through its pynvml wrapper, and its answer is the simulated host's."""
    cluster = "4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f"
    host = host_of("gb200-nvl72-tray", mig_enabled={0}, fabric_cluster_uuid=cluster, fabric_clique=5)
    nv = bind(host)
    nv.nvmlInit()
    assert nv.nvmlSystemGetDriverVersion() == host.driver_version
    assert nv.nvmlSystemGetNVMLVersion().endswith(host.driver_version)
    assert nv.nvmlSystemGetCudaDriverVersion() == nv.nvmlSystemGetCudaDriverVersion_v2() == host.cuda_version
    assert nv.nvmlDeviceGetCount() == 4
    h, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    g = host.gpus[0]
    assert nv.nvmlDeviceGetUUID(h) == g.uuid and nv.nvmlDeviceGetName(h) == g.name
    assert nv.nvmlDeviceGetMemoryInfo(h).total == g.memory_mib << 20
    assert nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2).total == g.memory_mib << 20
    pci = nv.nvmlDeviceGetPciInfo(h)
    assert pci.busId == g.bus_id and pci.bus == int(g.bus_id.split(":")[1], 16)
    assert nv.nvmlDeviceGetCudaComputeCapability(h) == (10, 0)
    assert nv.nvmlDeviceGetMinorNumber(h1) == 1  # /dev/nvidia1
    assert nv.nvmlDeviceGetNumaNodeId(h) == g.gpu_numa_id >= 0  # a Grace GPU's own memory node
    assert nv.nvmlDeviceGetTopologyCommonAncestor(h, h) == nv.NVML_TOPOLOGY_INTERNAL
    assert nv.nvmlDeviceGetTopologyCommonAncestor(h, h1) == host.ancestors[(0, 1)]
    assert nv.nvmlDeviceGetNvLinkState(h, 0) == nv.NVML_FEATURE_ENABLED
    assert nv.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).busId == g.links[0][1]
    assert nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0) == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
    v1 = nv.c_nvmlGpuFabricInfo_t()
    nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(v1))
    v2 = nv.c_nvmlGpuFabricInfoV_t()
    nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v2))
    assert bytes(v2.clusterUuid) == bytes.fromhex(cluster.replace("-", "")) and v2.cliqueId == 5
    assert v2.state == nv.NVML_GPU_FABRIC_STATE_COMPLETED and v2.status == nv.NVML_SUCCESS
    # MIG
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1] and nv.nvmlDeviceGetMigMode(h1) == [0, 0]
    assert nv.nvmlDeviceSetMigMode(h1, nv.NVML_DEVICE_MIG_ENABLE) == nv.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(h1) == [1, 1] and host.calls[-1] == ("set_mig_mode", 1, 1)
    info_v2 = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, nv.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    info_v1 = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, nv.NVML_GPU_INSTANCE_PROFILE_3_SLICE, version=1)
    assert (info_v2.id, info_v2.sliceCount, info_v2.instanceCount) == (info_v1.id, 3, 2) == (9, 3, 2)
    assert info_v2.name == "MIG 3g.93gb"
    count = ctypes.c_uint(0)
    placements = (nv.c_nvmlGpuInstancePlacement_t * 4)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, 9, placements, ctypes.byref(count))
    assert [(placements[i].start, placements[i].size) for i in range(count.value)] == [(0, 4), (4, 4)]
    gi_any = nv.nvmlDeviceCreateGpuInstance(h, 9)  # NVML picks the placement
    assert nv.nvmlGpuInstanceGetInfo(gi_any).placement.start == 0
    where = nv.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = 4, 4
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(where))
    gi_info = nv.nvmlGpuInstanceGetInfo(gi)
    assert (gi_info.id, gi_info.profileId, gi_info.placement.start) == (2, 9, 4)
    array = (nv.c_nvmlGpuInstance_t * 2)()
    nv.nvmlDeviceGetGpuInstances(h, 9, array, ctypes.byref(count))
    assert count.value == 2
    ci_v2 = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    ci_v1 = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, 1
    )
    assert ci_v2.id == ci_v1.id == nv.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE and ci_v2.sliceCount == 3
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_v2.id)
    assert nv.nvmlComputeInstanceGetInfo(ci).id == 0
    cis = (nv.c_nvmlComputeInstance_t * 1)()
    nv.nvmlGpuInstanceGetComputeInstances(gi, ci_v2.id, cis, ctypes.byref(count))
    assert count.value == 1
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    is_mig = [getattr(x, "value", x) for x in (nv.nvmlDeviceIsMigDeviceHandle(mig), nv.nvmlDeviceIsMigDeviceHandle(h))]
    assert is_mig == [1, 0]  # (the binding returns the c_uint itself)
    assert (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    assert nv.nvmlDeviceGetUUID(mig) == host.mig_device_uuid(0, 2, 0)
    with pytest.raises(nv.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)  # a compute instance is still in it
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    nv.nvmlGpuInstanceDestroy(gi_any)
    assert host.gpus[0].gis == []
    # health
    event_set = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(h1, nv.nvmlEventTypeXidCriticalError, event_set)
    host.inject_xid(1, 79)
    data = nv.nvmlEventSetWait(event_set, 100)
    assert (
        data.eventData == 79
        and ctypes.cast(data.device, ctypes.c_void_p).value == ctypes.cast(h1, ctypes.c_void_p).value
    )
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait(event_set, 10)
    nv.nvmlEventSetFree(event_set)
    host.gpus[0].ecc[(1, 0)] = 3
    assert nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC) == 3
    host.gpus[0].clocks_event_reasons = 0x40
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0x40
    assert str(nv.NVMLError(nv.NVML_ERROR_IN_USE)) == "In use by another client"  # nvmlErrorString
    nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    assert host.errors == []
    assert set(nv.nvmlLib._functions) == set(c_functions())  # every C function was reached


def test_argument_types_are_checked_as_a_c_prototype_would():
    nv = bind(host_of())
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    placement = nv.c_nvmlGpuInstancePlacement_t()
    with pytest.raises(ctypes.ArgumentError):  # a structure by value where nvml.h takes a pointer
        nv.nvmlLib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, placement, None)
    with pytest.raises(TypeError, match="takes 4 argument"):  # too few arguments for the C function
        nv.nvmlLib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, ctypes.byref(placement))
    with pytest.raises(TypeError):  # the bug the agent had: the binding needs the struct argument
        nv.nvmlDeviceGetGpuFabricInfo(h)


def test_a_function_the_driver_lacks_is_function_not_found():
    host = host_of()
    host.missing.add("nvmlDeviceGetGpuFabricInfoV")
    nv = bind(host)
    nv.nvmlInit()
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetGpuFabricInfoV(nv.nvmlDeviceGetHandleByIndex(0), ctypes.byref(nv.c_nvmlGpuFabricInfoV_t()))


def test_version_mismatch_as_nvml_answers_it():
    host = host_of("gb200-nvl72-tray", fabric_cluster_uuid="4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f")
    nv = bind(host)
    nv.nvmlInit()
    info = nv.c_nvmlGpuFabricInfoV_t()
    info.version = 0x01000010
    with pytest.raises(nv.NVMLError_ArgumentVersionMismatch):
        nv.nvmlDeviceGetGpuFabricInfoV(nv.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))


# ------------------------------------------------------------------------------------------------ structures

# nvml.h structure -> the installed binding's class of the same layout.
BINDING_STRUCTS = {
    "nvmlMemory_t": "c_nvmlMemory_t",
    "nvmlMemory_v2_t": "c_nvmlMemory_v2_t",
    "nvmlPciInfo_t": "nvmlPciInfo_t",
    "nvmlGpuInstancePlacement_t": "c_nvmlGpuInstancePlacement_t",
    "nvmlGpuInstanceProfileInfo_t": "c_nvmlGpuInstanceProfileInfo_t",
    "nvmlGpuInstanceProfileInfo_v2_t": "c_nvmlGpuInstanceProfileInfo_v2_t",
    "nvmlGpuInstanceInfo_t": "c_nvmlGpuInstanceInfo_t",
    "nvmlComputeInstanceProfileInfo_t": "c_nvmlComputeInstanceProfileInfo_t",
    "nvmlComputeInstanceProfileInfo_v2_t": "c_nvmlComputeInstanceProfileInfo_v2_t",
    "nvmlComputeInstanceInfo_t": "c_nvmlComputeInstanceInfo_t",
    "nvmlEventData_t": "c_nvmlEventData_t",
    "nvmlGpuFabricInfo_t": "c_nvmlGpuFabricInfo_t",
    "nvmlGpuFabricInfo_v2_t": "c_nvmlGpuFabricInfoV_t",
}


# Known deviations of the binding from nvml.h that do not move any field: nvmlGpuFabricState_t is an unsigned char
# in nvml.h and a c_uint in pynvml, read over the char and the padding after it (zero in a struct ctypes made).
WIDER_IN_THE_BINDING = {("nvmlGpuFabricInfo_t", "state"), ("nvmlGpuFabricInfo_v2_t", "state")}


def layout(struct, header: str, binding: bool = False) -> list[tuple[str, int, int]]:
    out = []
    for name, *_ in struct._fields_:
        field = getattr(struct, name)
        out.append((name, field.offset, 1 if binding and (header, name) in WIDER_IN_THE_BINDING else field.size))
    return out


@pytest.mark.parametrize("header", sorted(BINDING_STRUCTS))
def test_structures_match_the_installed_binding(header):
    ours = nvml_h.NVML_H_STRUCTS[header]
    theirs = getattr(pynvml, BINDING_STRUCTS[header])
    assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
    assert layout(ours, header) == layout(theirs, header, binding=True)


def test_struct_versions_are_nvml_struct_version():
    assert nvml_h.GI_PROFILE_INFO_V2 == pynvml.nvmlGpuInstanceProfileInfo_v2
    assert nvml_h.CI_PROFILE_INFO_V2 == pynvml.nvmlComputeInstanceProfileInfo_v2
    assert nvml_h.MEMORY_V2 == pynvml.nvmlMemory_v2
    assert nvml_h.FABRIC_INFO_V2 == pynvml.nvmlGpuFabricInfo_v2


# ------------------------------------------------------------------------------------------------ the agent's calls

AGENT_SOURCES = sorted((ROOT / "services" / "node_agent").glob("*.py"))


def nvml_calls(path: Path):
    """(function, positional count, keyword names, line) of each NVML call in a source file: `<x>.nvmlXxx(...)`,
    the MIG backend's `self._call(WHAT, nv.nvmlXxx, *args)`, and the calls discovery makes by name,
    `probes.call(PROBE, GPU, "nvmlXxx", *args)` and `_core(nv, WHAT, "nvmlXxx", *args)`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr.startswith("nvml"):
            yield node.func.attr, len(node.args), [k.arg for k in node.keywords], node.lineno
        if (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == "_call"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Attribute)
            and node.args[1].attr.startswith("nvml")
        ):
            yield node.args[1].attr, len(node.args) - 2, [], node.lineno  # MigBackend._call(what, nv.nvmlX, ...)
        by_name = (isinstance(node.func, ast.Attribute) and node.func.attr == "call") or (
            isinstance(node.func, ast.Name) and node.func.id == "_core"
        )
        if (
            by_name
            and len(node.args) >= 3
            and isinstance(node.args[2], ast.Constant)
            and str(node.args[2].value).startswith("nvml")
        ):
            yield (
                node.args[2].value,
                len(node.args) - 3,
                [k.arg for k in node.keywords if k.arg != "default"],
                node.lineno,
            )


def test_every_nvml_call_in_the_agent_has_the_bindings_signature():
    """Statically, every call site (also those no test reaches): the function exists in the installed
    nvidia-ml-py and accepts that many arguments."""
    seen, bad = set(), []
    for path in AGENT_SOURCES:
        for name, nargs, kwargs, line in nvml_calls(path):
            seen.add(name)
            fn = getattr(pynvml, name, None)
            where = f"{path.name}:{line} {name}"
            if fn is None:
                bad.append(f"{where}: not in nvidia-ml-py {pynvml.__file__}")
                continue
            try:
                inspect.signature(fn).bind(*([None] * nargs), **dict.fromkeys(kwargs))
            except TypeError as exc:
                bad.append(f"{where}: {exc} (signature {inspect.signature(fn)})")
    assert not bad, "\n".join(bad)
    assert {
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlEventSetWait",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetNvLinkRemotePciInfo",
        "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceSetMigMode",
    } <= seen


def test_the_static_check_catches_the_old_fabric_call(tmp_path):
    bad = tmp_path / "old.py"
    bad.write_text("def f(nv, h):\n    return nv.nvmlDeviceGetGpuFabricInfo(h)\n")
    ((name, nargs, kwargs, _),) = nvml_calls(bad)
    with pytest.raises(TypeError):
        inspect.signature(getattr(pynvml, name)).bind(*([None] * nargs), **dict.fromkeys(kwargs))


def audited(nv):
    """Wrap every nvml* function of a bound module so each call is checked against the binding's signature."""
    calls, mismatches = [], []
    for name in [n for n in dir(nv) if n.startswith("nvml") and callable(getattr(nv, n))]:
        fn = getattr(nv, name)
        if inspect.isclass(fn):
            continue
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def check(*args, _fn=fn, _sig=sig, _name=name, **kwargs):
            try:
                _sig.bind(*args, **kwargs)
            except TypeError as exc:
                mismatches.append(f"{_name}: {exc}")
            calls.append(_name)
            return _fn(*args, **kwargs)

        setattr(nv, name, check)
    return calls, mismatches


def test_discovery_mig_and_health_calls_bind_at_run_time(tmp_path):
    host = host_of("gb200-nvl72-tray", mig_enabled={0}, fabric_cluster_uuid="4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f")
    nv = bind(host)
    calls, mismatches = audited(nv)
    build_fake_sysfs(tmp_path, load_profile("gb200-nvl72-tray").dump, host.pci_bus_ids)
    topo = discover_topology("n1", use_nvidia_smi=False, nvml=nv, sysfs_root=tmp_path)
    topo.profile = "gb200-nvl72-tray"
    m = MigManager(NvmlMigBackend.for_topology(topo, nv), topo)
    got = m.acquire("j/1/0", [{"gpu": 0, "profile": "1g.23gb+me", "start": 0, "size": 1}])
    m.release("j/1/0", got)
    mon = HealthMonitor(NvmlHealthSource(nv, event_timeout_ms=10), len(topo.gpus))
    mon.check()
    mon.close()
    assert mismatches == [] and host.errors == []
    assert {
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlComputeInstanceGetInfo",
        "nvmlGpuInstanceDestroy",
        "nvmlEventSetWait",
        "nvmlDeviceGetTotalEccErrors",
    } <= set(calls)


# ------------------------------------------------------------------------------------------------ probes

# (C function, how it fails, the probe named in the warning, or None when the failure is a normal answer).
PROBE_FAILURES = [
    ("nvmlDeviceGetName", 999, "name"),
    ("nvmlDeviceGetMemoryInfo", 3, "memory"),
    ("nvmlDeviceGetCudaComputeCapability", "missing", "compute_capability"),
    ("nvmlDeviceGetNvLinkState", 999, "nvlink_state"),
    ("nvmlDeviceGetNvLinkState", 3, None),  # NotSupported: a GPU without NVLink
    ("nvmlDeviceGetNvLinkRemotePciInfo_v2", 999, "nvlink_remote_pci_info"),
    ("nvmlDeviceGetNvLinkRemoteDeviceType", "missing", "nvlink_remote_device_type"),
    ("nvmlDeviceGetTopologyCommonAncestor", 3, "topology_common_ancestor", "pcie-2numa"),
    ("nvmlDeviceGetGpuFabricInfoV", 999, "gpu_fabric_info"),
    ("nvmlDeviceGetGpuFabricInfoV", "missing", None),  # an older driver: the first version answers
    ("nvmlDeviceGetMigMode", 999, "mig_mode"),
    ("nvmlDeviceGetMigMode", "missing", "mig_mode"),
    ("nvmlDeviceGetGpuInstanceProfileInfoV", 999, None),  # a profile query that fails: no instances listed
]


@pytest.mark.parametrize("case", PROBE_FAILURES, ids=[f"{c[0]}-{c[1]}" for c in PROBE_FAILURES])
def test_a_failing_optional_probe_leaves_the_fact_unknown_and_warns_once(tmp_path, case):
    c_name, how, probe, profile = (*case, "gb200-nvl72-tray")[:4]
    host = host_of(profile, mig_enabled={0}, fabric_cluster_uuid="4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f")
    if how == "missing":
        host.missing.add(c_name)
    else:
        host.fail[c_name] = how
    build_fake_sysfs(tmp_path, load_profile(profile).dump, host.pci_bus_ids)
    with capture_logs() as logs:
        topo = discover_topology("n1", use_nvidia_smi=False, nvml=bind(host), sysfs_root=tmp_path)
    assert [g.uuid for g in topo.gpus] == [g.uuid for g in host.gpus]  # the node still registers
    warnings = [e for e in logs if e["event"] == "nvml_probe_failed"]
    if probe is None:
        assert warnings == []
    else:
        assert [w["probe"] for w in warnings] == [probe]  # once, however many GPUs failed it
        assert warnings[0]["error"] and warnings[0]["log_level"] == "warning"
    if c_name == "nvmlDeviceGetName":
        assert {g.name for g in topo.gpus} == {""}
    if c_name == "nvmlDeviceGetGpuFabricInfoV" and how == "missing":
        assert topo.fabric_cluster_uuid  # from nvmlDeviceGetGpuFabricInfo
    if c_name == "nvmlDeviceGetMigMode":
        assert {g.mig_mode for g in topo.gpus} == {agent_pb2.GpuInfo.MIG_MODE_UNSUPPORTED}


def test_a_binding_fault_in_a_probe_is_logged_not_raised(tmp_path):
    host = host_of()
    nv = bind(host)

    def broken(handle):
        raise TypeError("nvmlDeviceGetCudaComputeCapability() takes 2 positional arguments")

    nv.nvmlDeviceGetCudaComputeCapability = broken
    with capture_logs() as logs:
        topo = discover_topology("n1", use_nvidia_smi=False, nvml=nv, sysfs_root=tmp_path)
    assert len(topo.gpus) == 8 and {g.compute_capability for g in topo.gpus} == {""}
    (w,) = [e for e in logs if e["event"] == "nvml_probe_failed"]
    assert w["probe"] == "compute_capability" and "TypeError" in w["error"] and w["gpus"] == list(range(8))


@pytest.mark.parametrize(
    "c_name", ["nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo_v3"]
)
def test_the_core_enumeration_is_fatal_with_what_to_check(tmp_path, c_name):
    host = host_of()
    host.fail[c_name] = 999
    with pytest.raises(DiscoveryError, match="check that the NVIDIA driver is loaded.*libnvidia-ml.so.1"):
        discover_topology("n1", nvml=bind(host), sysfs_root=tmp_path, use_nvidia_smi=False)


def test_init_failure_names_driver_library_and_simulation(tmp_path):
    host = host_of()
    host.init_error = sim.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(DiscoveryError, match="NVML Shared Library Not Found.*driver.*--simulate"):
        discover_topology("n1", nvml=bind(host), sysfs_root=tmp_path)


# ------------------------------------------------------------------------------------------------ fabric

CLUSTER = "4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f"


@pytest.mark.parametrize(
    "state,status,in_domain,reason",
    [
        (sim.NVML_GPU_FABRIC_STATE_COMPLETED, 0, True, ""),
        (sim.NVML_GPU_FABRIC_STATE_IN_PROGRESS, 0, False, "IN_PROGRESS, not COMPLETED"),
        (sim.NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, False, "NOT_STARTED, not COMPLETED"),
        (sim.NVML_GPU_FABRIC_STATE_COMPLETED, sim.NVML_ERROR_UNKNOWN, False, "error status 999"),
        (sim.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, 0, False, ""),
    ],
)
def test_fabric_domain_only_when_completed_with_success(tmp_path, state, status, in_domain, reason):
    host = host_of(
        "gb200-nvl72-tray", fabric_cluster_uuid=CLUSTER, fabric_clique=7, fabric_state=state, fabric_status=status
    )
    topo = discover_topology("n1", nvml=bind(host), sysfs_root=tmp_path, use_nvidia_smi=False)
    if in_domain:
        assert (topo.fabric_cluster_uuid, topo.fabric_clique, topo.fabric_reason) == (CLUSTER, "7", "")
        assert {(g.fabric_cluster_uuid, g.fabric_clique) for g in topo.gpus} == {(CLUSTER, "7")}
    else:
        assert (topo.fabric_cluster_uuid, topo.fabric_clique) == ("", "")
        assert all(reason in g.fabric_reason for g in topo.gpus)
        assert (reason in topo.fabric_reason) and (bool(topo.fabric_reason) == bool(reason))


def test_one_gpu_not_completed_takes_the_host_out_of_the_domain(tmp_path):
    host = host_of("gb200-nvl72-tray", fabric_cluster_uuid=CLUSTER, fabric_clique=1)
    nv = bind(host)
    real_v = nv.nvmlDeviceGetGpuFabricInfoV

    def gpu2_in_progress(handle, info):
        real_v(handle, info)
        ptr = ctypes.cast(info, ctypes.POINTER(sim.nvmlGpuFabricInfo_v2_t))
        if (
            ctypes.cast(handle, ctypes.c_void_p).value
            == ctypes.cast(nv.nvmlDeviceGetHandleByIndex(2), ctypes.c_void_p).value
        ):
            ptr.contents.state = sim.NVML_GPU_FABRIC_STATE_IN_PROGRESS

    nv.nvmlDeviceGetGpuFabricInfoV = gpu2_in_progress
    topo = discover_topology("n1", nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False)
    assert (topo.fabric_cluster_uuid, topo.fabric_clique) == ("", "")
    assert topo.fabric_reason == "GPU 2: fabric registration is IN_PROGRESS, not COMPLETED"
    assert [bool(g.fabric_cluster_uuid) for g in topo.gpus] == [True, True, False, True]


def test_simulated_profiles_keep_their_fabric():
    topo = simulated_topology("tray-1", "gb200-nvl72-tray", fabric_clique="3")
    assert topo.fabric_cluster_uuid and topo.fabric_clique == "3" and topo.fabric_reason == ""


# ------------------------------------------------------------------------------------------------ versions


def pinned_range() -> tuple[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"nvidia-ml-py>=([\d.]+),<([\d.]+)"', text)
    assert m, "pyproject.toml pins nvidia-ml-py to a range >=OLDEST,<NEXT"
    return m.group(1), m.group(2)


def run_scenario(pythonpath: str | None) -> dict:
    env = {**os.environ}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, str(ROOT)])
    out = subprocess.run(
        [sys.executable, str(HELPERS / "nvml_scenario.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_installed_binding_is_in_the_pinned_range():
    from importlib.metadata import version

    oldest, below = pinned_range()
    have = tuple(int(x) for x in version("nvidia-ml-py").split("."))
    assert tuple(int(x) for x in oldest.split(".")) <= have < tuple(int(x) for x in below.split("."))


@pytest.mark.slow
def test_oldest_binding_in_the_range_gives_the_same_answers():
    oldest, _ = pinned_range()
    target = ROOT / ".venv" / f"nvidia-ml-py-{oldest}"
    installed = (target / "pynvml.py").exists()
    need(
        "oldest-nvml",
        None if installed else f"nvidia-ml-py {oldest} is not installed at {target} (scripts/test installs it)",
    )
    newest = run_scenario(None)
    old = run_scenario(str(target))
    assert old["binding"].startswith(str(target)) and not newest["binding"].startswith(str(target))
    assert old.pop("binding") != newest.pop("binding")
    assert old == newest
    assert newest["fabric"] == [CLUSTER, "4"] and newest["mig"] and newest["errors"] == []
