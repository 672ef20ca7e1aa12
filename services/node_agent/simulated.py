"""Simulated hosts: a HostTopology from a shipped profile (phalanx.profiles) or any `nvidia-smi topo -m` file.

GPU UUIDs are deterministic (derived from node name + GPU index), so a restarted simulated agent reports the
same GPUs and two simulated nodes never share one. The compute capability follows the GPU model; MIG mode is left
unreported (simulated MIG needs no mode switch). tests/test_fake_nvml_discovery.py checks that this topology is
the one the production NVML/sysfs discovery finds on a fake host built from the same dump.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from phalanx.api.v1 import agent_pb2
from phalanx.profiles import HostProfile, load_profile, load_profile_file
from phalanx.testing.fake_nvml import model_traits

from .topology import topology_from_dump

_NAMESPACE = uuid.UUID("5a1a9f0e-8c1e-4b8e-9a57-70b1a7e0c0de")
# PCI buses of the GPUs on an 8-GPU HGX baseboard, as NVML shows them.
_HGX_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]


def fake_gpu_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_NAMESPACE, f'{node_name}/{index}')}"


def fake_pci_bus_id(index: int, count: int) -> str:
    bus = _HGX_BUSES[index] if count <= len(_HGX_BUSES) else 0x10 + index
    return f"00000000:{bus:02X}:00.0"


def topology_from_profile(
    node_name: str, profile: HostProfile, *, fabric_cluster_uuid: str = "", fabric_clique: str = ""
) -> agent_pb2.HostTopology:
    n = profile.gpu_count
    if profile.nvlink_domain and not fabric_cluster_uuid:
        # One simulated NVL72 fabric cluster per profile unless told otherwise; the clique says which rack (NVLink
        # domain) of it the tray is in: "0" unless given (`phalanx cluster up` gives each rack of 18 its own).
        fabric_cluster_uuid = str(uuid.uuid5(_NAMESPACE, f"fabric/{profile.name}"))
        fabric_clique = fabric_clique or "0"
    topo = topology_from_dump(
        profile.dump,
        gpu_model=profile.gpu_model,
        memory_mib=profile.memory_mib,
        uuids=[fake_gpu_uuid(node_name, int(g[3:])) for g in profile.dump.gpus],
        pci_bus_ids=[fake_pci_bus_id(i, n) for i in range(n)],
        profile=profile.name,
        fabric_cluster_uuid=fabric_cluster_uuid,
        fabric_clique=fabric_clique,
    )
    cc, _ = model_traits(profile.gpu_model)
    if cc != (0, 0):
        for g in topo.gpus:
            g.compute_capability = f"{cc[0]}.{cc[1]}"
    return topo


def simulated_topology(
    node_name: str,
    profile: str | None = None,
    dump_file: str | Path | None = None,
    *,
    fabric_cluster_uuid: str = "",
    fabric_clique: str = "",
) -> agent_pb2.HostTopology:
    """The topology of a simulated host: from a shipped profile name, or from a dump/profile file."""
    if (profile is None) == (dump_file is None):
        raise ValueError("give exactly one of profile or dump_file")
    prof = load_profile(profile) if profile is not None else load_profile_file(dump_file)
    return topology_from_profile(
        node_name, prof, fabric_cluster_uuid=fabric_cluster_uuid, fabric_clique=fabric_clique
    )
