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


def test_the_tree_parser_still_refuses_block_lines():
    with pytest.raises(FabricError, match="block topology"):
        parse_slurm_tree(BLOCKS)


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
