"""Simulated hosts: the production NVML discovery, through the real nvidia-ml-py bindings, over a simulated NVML C
library (phalanx.simhost.nvml) and a simulated sysfs tree (phalanx.simhost.sysfs), built from a shipped profile
(phalanx.profiles) or any `nvidia-smi topo -m` file.

GPU UUIDs are deterministic (derived from node name + GPU index), so a restarted simulated agent reports the
same GPUs and two simulated nodes never share one. MIG-capable GPUs are in MIG mode only where asked (`mig_gpus`,
`phalanx-agent --simulate-mig`); the MIG instances and modes of a simulated host live in
`<state_dir>/simulated-gpus.json`, so they survive an agent restart the way a real GPU's do.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.api.v1 import agent_pb2
from phalanx.core.mig import parse_gpu_indexes
from phalanx.core.topo_dump import TopoDump
from phalanx.profiles import HostProfile, load_profile, load_profile_file
from phalanx.simhost.nvml import SimulatedHost, bind, load_bindings
from phalanx.simhost.sysfs import build_fake_sysfs

from .discovery import discover_topology
from .topology import topology_to_dump

_NAMESPACE = uuid.UUID("5a1a9f0e-8c1e-4b8e-9a57-70b1a7e0c0de")
# PCI buses of the GPUs on an 8-GPU HGX baseboard, as NVML shows them.
_HGX_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
STATE_FILE = "simulated-gpus.json"


def fake_gpu_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_NAMESPACE, f'{node_name}/{index}')}"


def fake_pci_bus_id(index: int, count: int) -> str:
    bus = _HGX_BUSES[index] if count <= len(_HGX_BUSES) else 0x10 + index
    return f"00000000:{bus:02X}:00.0"


def parse_mig_gpus(spec: str | Iterable[int] | None, count: int) -> set[int]:
    """`--simulate-mig` values: "all", "none"/"", or comma-separated GPU indexes ("6,7")."""
    if spec is None:
        return set()
    if not isinstance(spec, str):
        return {int(i) for i in spec}
    try:
        return set(parse_gpu_indexes(spec, count))
    except ValueError as exc:
        raise ValueError(f"--simulate-mig: {exc}") from exc


@dataclass
class SimulatedNode:
    """A simulated host with its NVML bindings (a private pynvml bound to the host) and its discovered topology."""

    host: SimulatedHost
    nvml: Any
    topology: agent_pb2.HostTopology
    profile: HostProfile | None = None  # what it was made from (its host CPUs and memory: host_resources.py)


def _fabric_of(prof: HostProfile, cluster: str, clique: str) -> tuple[str, str]:
    if prof.nvlink_domain and not cluster:
        # One simulated NVL72 fabric cluster per profile unless told otherwise; the clique says which rack (NVLink
        # domain) of it the tray is in: "0" unless given (`phalanx cluster up` gives each rack of 18 its own).
        return str(uuid.uuid5(_NAMESPACE, f"fabric/{prof.name}")), clique or "0"
    return cluster, clique


def _discover(
    node_name: str, host: SimulatedHost, nvml: Any, dump: TopoDump, profile_name: str, sysfs_root: Path | None
) -> agent_pb2.HostTopology:
    if sysfs_root is None:
        with tempfile.TemporaryDirectory(prefix="phalanx-sysfs-") as tmp:
            build_fake_sysfs(tmp, dump, host.pci_bus_ids)
            topo = discover_topology(node_name, use_nvidia_smi=False, nvml=nvml, sysfs_root=tmp)
    else:
        shutil.rmtree(sysfs_root, ignore_errors=True)  # made anew at every start, like /sys at boot
        build_fake_sysfs(sysfs_root, dump, host.pci_bus_ids)
        topo = discover_topology(node_name, use_nvidia_smi=False, nvml=nvml, sysfs_root=sysfs_root)
    topo.profile = profile_name
    return topo


def simulated_node(
    node_name: str,
    profile: str | None = None,
    dump_file: str | Path | None = None,
    *,
    fabric_cluster_uuid: str = "",
    fabric_clique: str = "",
    mig_gpus: str | Iterable[int] | None = None,
    state_dir: str | Path | None = None,
    nvml: Any = None,
) -> SimulatedNode:
    """A simulated host from a shipped profile name or a dump/profile file, discovered through the real bindings.
    With `state_dir`, its MIG state persists there and its sysfs tree is built there (`sysfs/`)."""
    if profile is not None and dump_file is None:
        prof = load_profile(profile)
    elif profile is None and dump_file is not None:
        prof = load_profile_file(dump_file)
    else:
        raise ValueError("give exactly one of profile or dump_file")
    cluster, clique = _fabric_of(prof, fabric_cluster_uuid, fabric_clique)
    n = prof.gpu_count
    state = Path(state_dir) if state_dir is not None else None
    host = SimulatedHost.from_dump(
        prof.dump,
        gpu_model=prof.gpu_model,
        memory_mib=prof.memory_mib,
        uuids=[fake_gpu_uuid(node_name, int(g[3:])) for g in prof.dump.gpus],
        pci_bus_ids=[fake_pci_bus_id(i, n) for i in range(n)],
        node_name=node_name,
        mig_enabled=parse_mig_gpus(mig_gpus, n),
        fabric_cluster_uuid=cluster,
        fabric_clique=clique,
        state_file=state / STATE_FILE if state is not None else None,
    )
    nv = bind(host, nvml)
    topo = _discover(node_name, host, nv, prof.dump, prof.name, state / "sysfs" if state is not None else None)
    return SimulatedNode(host, nv, topo, prof)


_shared_lock = threading.Lock()
_shared_bindings: list[Any] = []


def simulated_topology(
    node_name: str,
    profile: str | None = None,
    dump_file: str | Path | None = None,
    *,
    fabric_cluster_uuid: str = "",
    fabric_clique: str = "",
    mig_gpus: str | Iterable[int] | None = None,
) -> agent_pb2.HostTopology:
    """The topology of a simulated host: from a shipped profile name, or from a dump/profile file."""
    with _shared_lock:  # one private binding instance, rebound for each call
        if not _shared_bindings:
            _shared_bindings.append(load_bindings("pynvml_simulated_topology"))
        return simulated_node(
            node_name,
            profile,
            dump_file,
            fabric_cluster_uuid=fabric_cluster_uuid,
            fabric_clique=fabric_clique,
            mig_gpus=mig_gpus,
            nvml=_shared_bindings[0],
        ).topology


def host_for_topology(topology: agent_pb2.HostTopology, state_file: str | Path | None = None) -> SimulatedHost:
    """A simulated host that answers NVML as `topology` describes it (for an agent given a simulated topology
    but no bindings): the same GPUs, UUIDs, bus ids, links, MIG modes and fabric."""
    dump = topology_to_dump(topology)
    migs = {g.index for g in topology.gpus if g.mig_mode == agent_pb2.GpuInfo.MIG_MODE_ENABLED}
    gpu0 = topology.gpus[0] if topology.gpus else agent_pb2.GpuInfo()
    host = SimulatedHost.from_dump(
        dump,
        gpu_model=gpu0.name,
        memory_mib=gpu0.memory_mib,
        uuids=[g.uuid for g in topology.gpus],
        pci_bus_ids=[g.pci_bus_id for g in topology.gpus],
        mig_enabled=migs,
        fabric_cluster_uuid=topology.fabric_cluster_uuid,
        fabric_clique=topology.fabric_clique,
        state_file=state_file,
    )
    for sim, g in zip(host.gpus, topology.gpus, strict=True):
        sim.name, sim.memory_mib = g.name, g.memory_mib
    return host


def nvml_for_topology(topology: agent_pb2.HostTopology, state_dir: str | Path) -> Any:
    """NVML bindings for an agent given a simulated topology (AgentConfig.simulated_nvml): a private pynvml bound
    to a simulated host that answers as `topology` describes it, its MIG state kept in `state_dir`."""
    return bind(host_for_topology(topology, Path(state_dir) / STATE_FILE))
