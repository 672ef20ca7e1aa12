"""Conversions between a parsed `nvidia-smi topo -m` dump and the proto HostTopology, and its JSON/table views."""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.api.v1 import agent_pb2
from phalanx.core.topo_dump import TopoDump, render_topo

# A GPU's `nic` is a NIC at most this far from it (PIX or PXB: no host bridge on the way).
NIC_FARTHEST = "PXB"


def topology_from_dump(
    dump: TopoDump,
    *,
    gpu_model: str,
    memory_mib: int,
    uuids: Sequence[str],
    pci_bus_ids: Sequence[str],
    profile: str,
    fabric_cluster_uuid: str = "",
    fabric_clique: str = "",
    nic_numa: dict[str, int] | None = None,
    nic_pci_bus_ids: dict[str, str] | None = None,
) -> agent_pb2.HostTopology:
    """Build the proto topology: GPUs (closest NIC, NUMA node), NICs (device, nearest GPU) and the matrix.

    The matrix holds, for each device row in the dump, its cell to every other device (the diagonal is left out).
    """
    nearest_nic = dump.nearest_nics(NIC_FARTHEST)
    nearest_gpu = dump.nearest_gpus(NIC_FARTHEST)
    nic_numa = nic_numa or {}
    nic_pci_bus_ids = nic_pci_bus_ids or {}
    topo = agent_pb2.HostTopology(profile=profile, fabric_cluster_uuid=fabric_cluster_uuid, fabric_clique=fabric_clique)
    for i, gpu in enumerate(dump.gpus):
        topo.gpus.append(
            agent_pb2.GpuInfo(
                index=int(gpu[3:]),
                uuid=uuids[i],
                name=gpu_model,
                memory_mib=memory_mib,
                pci_bus_id=pci_bus_ids[i],
                numa_node=dump.numa_node(gpu),
                nic=nearest_nic.get(gpu, ""),
            )
        )
    for nic in dump.nics:
        g = nearest_gpu.get(nic)
        topo.nics.append(
            agent_pb2.NicInfo(
                name=nic,
                device=dump.nic_device(nic),
                nearest_gpu=int(g[3:]) if g else -1,
                numa_node=nic_numa.get(nic, -1),
                pci_bus_id=nic_pci_bus_ids.get(nic, ""),
            )
        )
    for row in dump.devices:
        cells = {}
        for col in dump.devices:
            if col == row:
                continue
            value = dump.cell(row, col)
            if value is not None:
                cells[col] = value
        if cells:
            topo.matrix[row].cells.update(cells)
    return topo


def topology_to_dump(topo: agent_pb2.HostTopology) -> TopoDump:
    """The topology as a TopoDump (for rendering it like `nvidia-smi topo -m`)."""
    devices = [f"GPU{g.index}" for g in topo.gpus] + [n.name for n in topo.nics]
    matrix = {}
    for row in devices:
        if row not in topo.matrix:
            continue
        cells = topo.matrix[row].cells
        matrix[row] = {col: ("X" if col == row else cells.get(col, "N/A")) for col in devices}
    extras = {f"GPU{g.index}": {"NUMA Affinity": str(g.numa_node) if g.numa_node >= 0 else "N/A"} for g in topo.gpus}
    return TopoDump(
        devices=devices,
        matrix=matrix,
        extras=extras,
        extra_columns=["NUMA Affinity"],
        nic_devices={n.name: n.device for n in topo.nics if n.device},
        has_legend=True,
    )


def render_topology(topo: agent_pb2.HostTopology) -> str:
    """A `nvidia-smi topo -m`-style table, preceded by one line per GPU (index, model, memory, UUID, bus id)."""
    mode_names = {agent_pb2.GpuInfo.MIG_MODE_ENABLED: " (MIG on)", agent_pb2.GpuInfo.MIG_MODE_DISABLED: " (MIG off)"}
    lines = [
        f"GPU {g.index}: {g.name} ({g.memory_mib} MiB) (UUID: {g.uuid}) (PCI: {g.pci_bus_id})"
        + mode_names.get(g.mig_mode, "")
        for g in topo.gpus
    ]
    if topo.fabric_cluster_uuid:
        lines.append(f"NVLink fabric: cluster {topo.fabric_cluster_uuid}, clique {topo.fabric_clique}")
    elif topo.fabric_reason:
        lines.append(f"NVLink fabric: none ({topo.fabric_reason})")
    head = "\n".join(lines) + ("\n\n" if lines else "")
    return head + render_topo(topology_to_dump(topo))


def topology_to_json(topo: agent_pb2.HostTopology) -> dict:
    return {
        "profile": topo.profile,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_mib": g.memory_mib,
                "pci_bus_id": g.pci_bus_id,
                "numa_node": g.numa_node,
                "nic": g.nic,
                "compute_capability": g.compute_capability,
                "mig_mode": agent_pb2.GpuInfo.MigMode.Name(g.mig_mode).removeprefix("MIG_MODE_").lower(),
                "mig_instances": [
                    {
                        "profile": m.profile,
                        "start": m.start,
                        "size": m.size,
                        "uuid": m.uuid,
                        "managed": m.managed,
                        "gpu_instance_id": m.gpu_instance_id,
                        "compute_instance_id": m.compute_instance_id,
                    }
                    for m in g.mig_instances
                ],
                "fabric_cluster_uuid": g.fabric_cluster_uuid,
                "fabric_clique": g.fabric_clique,
                "fabric_reason": g.fabric_reason,
            }
            for g in topo.gpus
        ],
        "nics": [
            {
                "name": n.name,
                "device": n.device,
                "nearest_gpu": n.nearest_gpu,
                "numa_node": n.numa_node,
                "pci_bus_id": n.pci_bus_id,
            }
            for n in topo.nics
        ],
        "matrix": {row: dict(sorted(topo.matrix[row].cells.items())) for row in topo.matrix},
        "fabric_cluster_uuid": topo.fabric_cluster_uuid,
        "fabric_clique": topo.fabric_clique,
        "fabric_reason": topo.fabric_reason,
    }
