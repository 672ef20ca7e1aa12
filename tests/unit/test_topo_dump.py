"""The `nvidia-smi topo -m` parser, renderer and closeness ranking, on hand-written and real dumps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.required import data_missing, needs
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.topo_dump import (
    TopoDump,
    TopoParseError,
    link_rank,
    matrix_from_pairs,
    parse_topo,
    render_topo,
    sort_by_closeness,
)

TOPOLOGIES = (
    Path(os.environ.get("PHALANX_DATA", Path(__file__).resolve().parents[3] / "shared" / "data")) / "topologies"
)

TABBED = (
    "# a comment\n"
    "nvidia-smi topo -m\n"
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV4\tPXB\t0-15\t0\t\tN/A\n"
    "GPU1\tNV4\t X \tSYS\t16-31\t1\t\tN/A\n"
    "NIC0\tPXB\tSYS\t X \n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)


def test_parse_tabs_comments_extras_and_legends():
    d = parse_topo(TABBED)
    assert d.devices == ["GPU0", "GPU1", "NIC0"]
    assert d.gpus == ["GPU0", "GPU1"] and d.nics == ["NIC0"]
    assert d.matrix["GPU0"] == {"GPU0": "X", "GPU1": "NV4", "NIC0": "PXB"}
    assert d.matrix["NIC0"]["GPU1"] == "SYS"
    assert d.extra_columns == ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    assert d.cpu_affinity("GPU1") == "16-31"
    assert d.numa_affinity("GPU0") == "0" and d.numa_node("GPU1") == 1
    assert d.gpu_numa_id("GPU0") is None  # N/A
    assert d.nic_devices == {"NIC0": "mlx5_0"} and d.nic_device("NIC0") == "mlx5_0"
    assert d.has_legend
    assert d.nearest_nics() == {"GPU0": "NIC0"}  # GPU1 only reaches it through SYS
    assert d.nearest_gpus() == {"NIC0": "GPU0"}


def test_spaces_and_tabs_give_the_same_matrix():
    spaced = TABBED.replace("\t", "    ")
    assert parse_topo(spaced).matrix == parse_topo(TABBED).matrix
    assert parse_topo(spaced).extras == parse_topo(TABBED).extras


def test_not_a_dump_is_rejected():
    with pytest.raises(TopoParseError):
        parse_topo("hello\nworld\n")
    with pytest.raises(TopoParseError):
        parse_topo("\tGPU0\tGPU1\nGPU0\t X \n")  # short row


def test_closeness_ranking():
    assert link_rank("X") > link_rank("NV18") > link_rank("NV12") > link_rank("NV4") > link_rank("NV1")
    assert (
        link_rank("NV1") > link_rank("PIX") > link_rank("PXB") > link_rank("PHB") > link_rank("NODE") > link_rank("SYS")
    )
    assert sort_by_closeness(["SYS", "NV2", "PIX", "NODE", "NV18", "PHB", "PXB"]) == [
        "NV18",
        "NV2",
        "PIX",
        "PXB",
        "PHB",
        "NODE",
        "SYS",
    ]


def test_nearest_nic_ties_are_spread():
    # Two GPUs that both see two NICs as PXB (DGX A100 layout) get one NIC each.
    devices = ["GPU0", "GPU1", "NIC0", "NIC1"]
    d = TopoDump(
        devices=devices, matrix=matrix_from_pairs(devices, lambda a, b: "NV12" if a[:3] == b[:3] == "GPU" else "PXB")
    )
    assert d.nearest_nics() == {"GPU0": "NIC0", "GPU1": "NIC1"}


def _dump_files() -> list[Path]:
    if not TOPOLOGIES.is_dir():
        return []
    return sorted(TOPOLOGIES.glob("*.txt"))


@needs("data", data_missing(TOPOLOGIES, "real topology dumps"))
@pytest.mark.parametrize("path", _dump_files() or [TOPOLOGIES / "none.txt"], ids=lambda p: p.name)
def test_every_real_dump_parses_and_round_trips(path: Path):
    d = parse_topo(path.read_text())
    assert d.gpus, "no GPU columns"
    for row, cells in d.matrix.items():
        assert cells[row] == "X"
        assert set(cells) == set(d.devices)
        for col, cell in cells.items():
            assert link_rank(cell) > 0, f"{row}->{col}: unknown cell {cell!r}"
            # dumps are symmetric wherever both rows are present
            if col in d.matrix:
                assert d.matrix[col][row] == cell
    again = parse_topo(render_topo(d))
    assert again.matrix == d.matrix
    assert again.extras == d.extras
    assert again.nic_devices == d.nic_devices
    assert parse_topo(render_topo(again)).matrix == d.matrix


@needs("data", data_missing(TOPOLOGIES, "real topology dumps"))
def test_real_dump_facts():
    h100 = parse_topo((TOPOLOGIES / "hgx_h100_sxm_8gpu_8nic_sglang30401.txt").read_text())
    assert len(h100.gpus) == 8 and len(h100.nics) == 8
    assert all(h100.cell(a, b) == "NV18" for a in h100.gpus for b in h100.gpus if a != b)
    assert h100.nearest_nics() == {f"GPU{i}": f"NIC{i}" for i in range(8)}
    assert [h100.numa_node(g) for g in h100.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h100.cpu_affinity("GPU5") == "48-95,144-191"
    vm = parse_topo((TOPOLOGIES / "hgx_h20_8gpu_vm_nccl-tests321.txt").read_text())
    assert vm.nearest_nics()["GPU0"] == "NIC7"  # reversed pairing
    assert not vm.has_legend and vm.nic_devices == {}
    pcie = parse_topo((TOPOLOGIES / "pcie_8x_rtx4090_2nic_go-gpuallocator17.txt").read_text())
    assert pcie.cell("GPU6", "NIC0") == "PHB" and pcie.nearest_nics() == {"GPU6": "NIC0"}
    partial = parse_topo((TOPOLOGIES / "hgx_b200_8gpu_partial_unsloth3872.txt").read_text())
    assert sorted(partial.matrix) == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4"]
    assert partial.cell("GPU7", "GPU0") == "NV18"  # from GPU0's row
    gb = parse_topo((TOPOLOGIES / "gb200_compute_tray_4gpu_8nic.txt").read_text())
    assert gb.numa_affinity("GPU0") == "0,3-9,11-17" and gb.numa_node("GPU0") == 0
    assert gb.gpu_numa_id("GPU3") == "26"


CELLS = st.sampled_from(["NV1", "NV2", "NV4", "NV8", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"])


@settings(max_examples=60, deadline=None)
@given(
    n_gpu=st.integers(1, 8),
    n_nic=st.integers(0, 4),
    data=st.data(),
    tabs=st.booleans(),
)
def test_round_trip_property(n_gpu, n_nic, data, tabs):
    devices = [f"GPU{i}" for i in range(n_gpu)] + [f"NIC{i}" for i in range(n_nic)]
    pairs = {}
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            pairs[(a, b)] = pairs[(b, a)] = data.draw(CELLS)
    extras = {
        g: {"CPU Affinity": f"{i * 8}-{i * 8 + 7}", "NUMA Affinity": str(i // 4), "GPU NUMA ID": "N/A"}
        for i, g in enumerate(devices[:n_gpu])
    }
    d = TopoDump(
        devices=devices,
        matrix=matrix_from_pairs(devices, lambda a, b: pairs[(a, b)]),
        extras=extras,
        extra_columns=["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"],
        nic_devices={f"NIC{i}": f"mlx5_{i}" for i in range(n_nic)},
    )
    text = render_topo(d)
    if tabs:
        text = "\n".join(
            "\t".join(line.split("  ")) if not line.startswith(" ") or "GPU0" in line else line
            for line in text.splitlines()
        )
    parsed = parse_topo(text)
    assert parsed.matrix == d.matrix
    assert parse_topo(render_topo(parsed)).matrix == parsed.matrix
    assert parsed.nic_devices == d.nic_devices
