"""Slurm block topology (`BlockName=` / `BlockSizes=`) and the syntax dispatch of parse_slurm / load_fabric."""

import pytest

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import FabricError, load_fabric, parse_slurm, parse_slurm_block, parse_slurm_tree
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.placement import place_gang

BLOCKS = """
# four NVL-style blocks of two nodes, aggregated by 4 and 8 nodes
BlockName=b1 Nodes=n[01-02]
BlockName=b2 Nodes=n[03-04]
BlockName=b3 Nodes=n[05-06]
BlockName=b4 Nodes=n[07-08]
BlockSizes=2,4,8
"""


def test_blocks_and_their_aggregates_become_tiers():
    fabric = parse_slurm_block(BLOCKS)
    assert fabric.tiers == ("block", "block2", "block3")
    assert fabric.path("n01") == ("b1", "agg2-0", "agg3-0")
    assert fabric.path("n04") == ("b2", "agg2-0", "agg3-0")
    assert fabric.path("n05") == ("b3", "agg2-1", "agg3-0")
    assert fabric.path("n08") == ("b4", "agg2-1", "agg3-0")
    assert fabric.path("elsewhere") == ()


def test_without_block_sizes_there_is_only_the_block_tier():
    fabric = parse_slurm_block("BlockName=b1 Nodes=n[01-18]\nBlockName=b2 Nodes=n[19-36]\n")
    assert fabric.tiers == ("block",)
    assert fabric.path("n18") == ("b1",) and fabric.path("n19") == ("b2",)
    assert len(fabric.paths) == 36


def test_a_base_size_alone_adds_no_aggregate_tier_and_trailing_groups_may_be_short():
    assert parse_slurm_block("BlockName=b1 Nodes=a\nBlockSizes=1").tiers == ("block",)
    fabric = parse_slurm_block("BlockName=b1 Nodes=a\nBlockName=b2 Nodes=b\nBlockName=b3 Nodes=c\nBlockSizes=1,2")
    assert [fabric.path(n)[1] for n in "abc"] == ["agg2-0", "agg2-0", "agg2-1"]


def test_parse_slurm_and_load_fabric_dispatch_by_content(tmp_path):
    tree = "SwitchName=leaf0 Nodes=n[01-02]\nSwitchName=spine0 Switches=leaf0\n"
    assert parse_slurm(tree) == parse_slurm_tree(tree)
    assert parse_slurm(BLOCKS) == parse_slurm_block(BLOCKS)
    conf = tmp_path / "topology.conf"
    conf.write_text(BLOCKS)
    assert load_fabric(conf).tiers == ("block", "block2", "block3")
    conf.write_text(tree)
    assert load_fabric(conf).tiers == ("leaf", "spine")
    # a commented-out BlockName does not switch syntax
    conf.write_text("# BlockName=b0 Nodes=x\n" + tree)
    assert load_fabric(conf).tiers == ("leaf", "spine")


@pytest.mark.parametrize(
    "text, words",
    [
        ("BlockName=b1 Nodes=a[1-2]\nSwitchName=s0 Nodes=a3", r"line 2: SwitchName= mixed"),
        ("SwitchName=s0 Nodes=a3\nBlockName=b1 Nodes=a[1-2]", r"line 1: SwitchName= mixed"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockName=b2 Nodes=a[2-3]", r"line 2: node 'a2' is in two blocks"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockSizes=2,3", r"line 2: .*3 is not a multiple of the base size 2"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockSizes=4,2", r"line 2: .*not a multiple"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockSizes=2,2", r"line 2: BlockSizes must increase"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockSizes=2,x", r"line 2: BlockSizes must be"),
        ("BlockName=b1 Nodes=a[1-2]\nBlockSizes=0", r"line 2: BlockSizes must be positive"),
        ("\n\nBlockName=b1 Nodes=a[1-", r"line 3: unbalanced"),
        ("BlockName=b1 Nodes=a[3-1]", r"line 1: bad range"),
        ("BlockName=b1 Nodes=a\nBlockName=b1 Nodes=b", r"line 2: block 'b1' is defined twice"),
        ("BlockName=b1", r"line 1: block 'b1' lists no Nodes="),
        ("BlockName=b1 Nodes=a\nBlockSizes=1\nBlockSizes=1", r"line 3: BlockSizes= given twice"),
        ("BlockName=b1 Nodes=a\nNodes=b", r"line 2: expected BlockName"),
    ],
)
def test_bad_block_files_say_which_line(text, words):
    with pytest.raises(FabricError, match=words):
        parse_slurm(text)


def test_placement_keeps_a_gang_inside_one_aggregate():
    fabric = parse_slurm_block(BLOCKS)
    cap = ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True, fabric.path(n)) for n in sorted(fabric.paths))
    placement = place_gang(cap, GangRequest("j", 4, 8), fabric.tiers)
    assert placement.tier == "block2"
    assert len({fabric.path(r.node)[1] for r in placement.replicas}) == 1


# -- writing block syntax (to_slurm_block) ----------------------------------------------------------------------


def test_block_syntax_round_trips():
    from phalanx.core.fabric import to_slurm_block

    fabric = parse_slurm_block(BLOCKS)
    text = to_slurm_block(fabric)
    assert text.splitlines()[-1] == "BlockSizes=2,4,8"
    again = parse_slurm_block(text)
    assert again.tiers == fabric.tiers and dict(again.paths) == dict(fabric.paths)
    assert to_slurm_block(again) == text


def test_nvlink_domains_are_written_as_blocks_with_their_leaves_and_spines_as_aggregates():
    from phalanx.core.fabric import default_fabric, group_nvlink_domains, to_slurm_block

    # 8 NVL72-style domains of 18 nodes, 2 per leaf, 2 leaves per spine, 2 spines
    names = [f"gb{i:03d}" for i in range(144)]
    fabric = group_nvlink_domains(default_fabric(names, nodes_per_leaf=36, leaves_per_spine=2), 18)
    text = to_slurm_block(fabric)
    assert "BlockSizes=18,36,72" in text
    back = parse_slurm(text)
    assert back.tiers == ("block", "block2", "block3")
    for a in names:  # the same partition at every tier: two nodes share a block (aggregate) iff they shared it
        for b in names[::17]:
            for level in range(3):
                assert (back.path(a)[level] == back.path(b)[level]) == (fabric.path(a)[level] == fabric.path(b)[level])


def test_non_uniform_tiers_are_left_out_and_a_fabric_without_tiers_is_refused():
    from phalanx.core.fabric import Fabric, default_fabric, to_slurm_block

    # 3 leaves of 4 nodes under spine0, 1 leaf under spine1: the spines do not group leaves uniformly... they do
    # (the last group may be short); 2 leaves under spine0 and 3 under spine1 do not.
    paths = {f"n{i}": (f"leaf{i // 2}", "spine0" if i < 4 else "spine1") for i in range(10)}
    text = to_slurm_block(Fabric(tiers=("leaf", "spine"), paths=paths))
    assert "BlockSizes" not in text and text.count("BlockName=") == 5
    assert parse_slurm(text).tiers == ("block",)
    short = to_slurm_block(default_fabric([f"n{i}" for i in range(12)], nodes_per_leaf=4, leaves_per_spine=2))
    assert short.splitlines()[-1] == "BlockSizes=4,8"
    with pytest.raises(FabricError, match="no tiers"):
        to_slurm_block(Fabric())


def test_the_tree_parser_reads_block_syntax():
    assert parse_slurm_tree(BLOCKS) == parse_slurm_block(BLOCKS)


@pytest.mark.parametrize(
    "names, text",
    [
        (["gb001", "gb002", "gb003"], "gb[001-003]"),
        (["n9", "n10", "n11"], "n[9-11]"),
        (["gb001", "gb002", "gb004", "x", "a1", "a01", "a02"], "gb[001-002,004],x,a[1,01-02]"),
        (["n1"], "n1"),
        (["dgx-a", "dgx-b"], "dgx-a,dgx-b"),
    ],
)
def test_hostlists_compress_and_expand_back(names, text):
    from phalanx.core.hostlist import compress_hostlist, expand_hostlist

    assert compress_hostlist(names) == text
    assert expand_hostlist(text) == names


def test_phalanx_fabric_export_writes_block_syntax(tmp_path, capsys):
    from phalanx.cli.main import main

    conf = tmp_path / "topology.conf"
    conf.write_text(
        "SwitchName=leaf0 Nodes=gb[001-036]\nSwitchName=leaf1 Nodes=gb[037-072]\nSwitchName=s Switches=leaf[0-1]\n"
    )
    assert main(["fabric", "export", "--fabric", str(conf), "--nvlink-domain-nodes", "18"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "BlockName=nvl-0 Nodes=gb[001-018]",
        "BlockName=nvl-1 Nodes=gb[019-036]",
        "BlockName=nvl-2 Nodes=gb[037-054]",
        "BlockName=nvl-3 Nodes=gb[055-072]",
        "BlockSizes=18,36,72",
    ]
    blocks = tmp_path / "blocks.conf"
    blocks.write_text(out)
    assert main(["fabric", "export", "--fabric", str(blocks), "--format", "slurm-tree"]) == 0
    tree = capsys.readouterr().out
    assert "SwitchName=nvl-0 Nodes=gb001,gb002," in tree and "SwitchName=agg2-0 Switches=nvl-0,nvl-1" in tree
    assert main(["fabric", "export", "--fabric", str(tmp_path / "none.conf")]) == 2
    assert "does not exist" in capsys.readouterr().err
