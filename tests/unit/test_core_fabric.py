"""Fabric descriptions: Slurm hostlists and topology.conf tree syntax, Phalanx YAML, and the round trip."""

import pytest

from phalanx.core.fabric import (
    FabricError,
    default_fabric,
    parse_fabric_yaml,
    parse_slurm_tree,
    to_slurm_tree,
)
from phalanx.core.hostlist import expand_hostlist


@pytest.mark.parametrize(
    "expr, names",
    [
        ("dgx[01-03]", ["dgx01", "dgx02", "dgx03"]),
        ("a,b[1,3]", ["a", "b1", "b3"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("node[008-010]", ["node008", "node009", "node010"]),
    ],
)
def test_hostlists_expand_like_slurm(expr, names):
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["n[1-", "n[3-1]", "n]1[", "n[,]"])
def test_malformed_hostlists_are_refused(expr):
    with pytest.raises(ValueError):
        expand_hostlist(expr)


TREE = """
# two leaves under one spine, a third leaf hanging off the core
SwitchName=leaf0 Nodes=dgx[01-04]
SwitchName=leaf1 Nodes=dgx[05-08]
SwitchName=leaf2 Nodes=dgx[09-10]
SwitchName=spine0 Switches=leaf[0-1]
SwitchName=core Switches=spine0,leaf2
"""


def test_slurm_tree_names_its_levels_leaf_spine_core():
    fabric = parse_slurm_tree(TREE)
    assert fabric.tiers == ("leaf", "spine", "core")
    assert fabric.path("dgx01") == ("leaf0", "spine0", "core")
    assert fabric.path("dgx08") == ("leaf1", "spine0", "core")
    # a leaf directly under the core keeps tier i at path[i]
    assert fabric.path("dgx09")[0] == "leaf2" and fabric.path("dgx09")[2] == "core"
    assert fabric.path("unknown") == ()


@pytest.mark.parametrize(
    "text, words",
    [
        ("SwitchName=s0 Switches=nope", "unknown switch"),
        ("SwitchName=s0 Nodes=a\nSwitchName=s1 Nodes=a", "two leaf switches"),
        ("SwitchName=s0 Nodes=a\nSwitchName=s0 Nodes=b", "defined twice"),
        ("SwitchName=s0 Nodes=a\nBlockName=b0 Nodes=b[1-4]", "mixed with block topology"),
        ("Nodes=a", "expected SwitchName"),
        ("SwitchName=s0", "neither Nodes= nor Switches="),
    ],
)
def test_bad_slurm_files_say_where(text, words):
    with pytest.raises(FabricError, match=words):
        parse_slurm_tree(text)


def test_deeper_trees_continue_with_numbered_tiers():
    text = "\n".join(
        [
            "SwitchName=l0 Nodes=n1",
            "SwitchName=s0 Switches=l0",
            "SwitchName=c0 Switches=s0",
            "SwitchName=t0 Switches=c0",
        ]
    )
    assert parse_slurm_tree(text).tiers == ("leaf", "spine", "core", "tier3")


def test_yaml_tree_and_flat_forms_agree_and_round_trip_through_slurm():
    tree = parse_fabric_yaml("""
tiers: [leaf, spine]
switches:
  spine0:
    leaf0: ["dgx[01-02]"]
    leaf1: ["dgx[03-04]"]
""")
    flat = parse_fabric_yaml(tree.to_yaml())
    assert (
        dict(tree.paths)
        == dict(flat.paths)
        == {
            "dgx01": ("leaf0", "spine0"),
            "dgx02": ("leaf0", "spine0"),
            "dgx03": ("leaf1", "spine0"),
            "dgx04": ("leaf1", "spine0"),
        }
    )
    assert dict(parse_slurm_tree(to_slurm_tree(tree)).paths) == dict(tree.paths)


def test_default_fabric_groups_nodes_into_leaves():
    fabric = default_fabric([f"n{i}" for i in range(10)], nodes_per_leaf=4)
    assert [fabric.path(f"n{i}")[0] for i in range(10)] == ["leaf0"] * 4 + ["leaf1"] * 4 + ["leaf2"] * 2
    assert dict(parse_slurm_tree(to_slurm_tree(fabric)).paths) == dict(fabric.paths)
