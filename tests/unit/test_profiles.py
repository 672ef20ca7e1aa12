"""Shipped simulated host profiles: loadable, well-formed, and faithful to the real machines they model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.required import data_missing, needs

from phalanx.core.topo_dump import parse_topo, render_topo
from phalanx.profiles import UnknownProfile, list_profiles, load_profile, load_profile_file
from services.node_agent.simulated import fake_gpu_uuid, simulated_topology

TOPOLOGIES = (
    Path(os.environ.get("PHALANX_DATA", Path(__file__).resolve().parents[3] / "shared" / "data")) / "topologies"
)
needs_dumps = needs("data", data_missing(TOPOLOGIES, "real topology dumps"))


def test_list_profiles():
    assert {"dgx-h100", "hgx-h200", "dgx-a100", "pcie-2numa", "gb200-nvl72-tray"} <= set(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_profile_well_formed(name):
    p = load_profile(name)
    assert p.name == name
    assert p.gpu_model.startswith("NVIDIA ") and p.memory_mib > 0
    d = p.dump
    assert set(d.matrix) == set(d.devices)  # full matrices
    for a in d.devices:
        for b in d.devices:
            assert d.matrix[a][b] == d.matrix[b][a]
    assert parse_topo(render_topo(d)).matrix == d.matrix
    # the profile text is ours: it says so
    assert "written for Phalanx" in p.text


def test_profile_facts():
    h100 = load_profile("dgx-h100")
    assert h100.gpu_model == "NVIDIA H100 80GB HBM3" and h100.gpu_count == 8
    assert h100.dump.nic_devices == {f"NIC{i}": f"mlx5_{i}" for i in range(8)}
    assert [h100.dump.numa_node(g) for g in h100.dump.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    h200 = load_profile("hgx-h200")
    assert h200.gpu_model == "NVIDIA H200" and h200.memory_mib > 140_000
    assert h200.dump.matrix == h100.dump.matrix
    a100 = load_profile("dgx-a100")
    assert all(a100.dump.cell(a, b) == "NV12" for a in a100.dump.gpus for b in a100.dump.gpus if a != b)
    assert a100.dump.cell("GPU0", "NIC1") == "PXB"
    pcie = load_profile("pcie-2numa")
    cells = {pcie.dump.cell(a, b) for a in pcie.dump.gpus for b in pcie.dump.gpus if a != b}
    assert not any(c.startswith("NV") for c in cells)
    assert {pcie.dump.numa_node(g) for g in pcie.dump.gpus} == {0, 1}
    gb = load_profile("gb200-nvl72-tray")
    assert gb.gpu_count == 4 and gb.nvlink_domain == "nvl72"
    assert all(gb.dump.cell(a, b) == "NV18" for a in gb.dump.gpus for b in gb.dump.gpus if a != b)


def test_unknown_profile():
    with pytest.raises(UnknownProfile, match="dgx-h100"):
        load_profile("no-such-host")


@needs_dumps
@pytest.mark.parametrize(
    "profile,dump",
    [
        ("dgx-h100", "hgx_h100_sxm_8gpu_8nic_sglang30401.txt"),
        ("hgx-h200", "hgx_h100_sxm_8gpu_8nic_sglang30401.txt"),  # same baseboard
        ("dgx-a100", "dgx_a100_8gpu_10nic.txt"),
        ("gb200-nvl72-tray", "gb200_compute_tray_4gpu_8nic.txt"),
    ],
)
def test_profile_matches_real_dump(profile, dump):
    ours = load_profile(profile).dump
    real = parse_topo((TOPOLOGIES / dump).read_text())
    assert ours.matrix == real.matrix
    assert ours.nic_devices == real.nic_devices
    assert [ours.numa_node(g) for g in ours.gpus] == [real.numa_node(g) for g in real.gpus]
    assert ours.nearest_nics() == real.nearest_nics()


def test_simulated_topology_is_deterministic_per_node():
    a1 = simulated_topology("node-a", "dgx-h100")
    a2 = simulated_topology("node-a", "dgx-h100")
    b = simulated_topology("node-b", "dgx-h100")
    assert [g.uuid for g in a1.gpus] == [g.uuid for g in a2.gpus]
    assert not {g.uuid for g in a1.gpus} & {g.uuid for g in b.gpus}
    assert a1.gpus[3].uuid == fake_gpu_uuid("node-a", 3)
    assert len({g.pci_bus_id for g in a1.gpus}) == 8
    assert a1.profile == "dgx-h100"
    gb = simulated_topology("tray-1", "gb200-nvl72-tray")
    assert gb.fabric_cluster_uuid


@needs_dumps
def test_simulate_from_any_dump():
    topo = simulated_topology("n", dump_file=TOPOLOGIES / "hgx_h20_8gpu_vm_nccl-tests321.txt")
    assert len(topo.gpus) == 8
    assert topo.gpus[0].nic == "NIC7" and topo.gpus[7].nic == "NIC0"
    assert topo.matrix["GPU0"].cells["GPU5"] == "NV18"
    assert load_profile_file(TOPOLOGIES / "dgx_a100_8gpu_10nic.txt").gpu_count == 8
