"""Ring cost (phalanx.core.cost): which leaves, spines and rails a placement's AllReduce traffic crosses.

On a rail-optimized fabric (`rails: N`) GPU i of every node hangs off rail switch i of its scalable unit, so a
ring hop whose channels change rail goes up to a spine even inside one unit; placement keeps local rank i on the
same GPU index on every node to avoid that (rail alignment).
"""

from __future__ import annotations

import pytest

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.cost import ring_cost
from phalanx.core.fabric import FabricError, default_fabric, parse_fabric_yaml
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang

RAIL_YAML = """\
tiers: [leaf, spine]
rails: 8
switches:
  spine0:
    su0: ["n[0-3]"]
    su1: ["n[4-7]"]
"""


def capacity(fabric, used: dict[str, set[int]] | None = None) -> ClusterCapacity:
    used = used or {}
    return ClusterCapacity(
        NodeCapacity(n, 8, set(range(8)) - used.get(n, set()), True, fabric.path(n)) for n in sorted(fabric.paths)
    )


def gang(*reps: tuple[str, tuple[int, ...]], tier: str = "leaf") -> Placement:
    return Placement("g", tuple(ReplicaPlacement(i, n, g) for i, (n, g) in enumerate(reps)), tier, 1, 0.0, "")


def test_rails_parse_and_round_trip():
    fabric = parse_fabric_yaml(RAIL_YAML)
    assert fabric.rails == 8 and fabric.tiers == ("leaf", "spine")
    assert parse_fabric_yaml(fabric.to_yaml()) == fabric
    assert parse_fabric_yaml(RAIL_YAML.replace("rails: 8\n", "")).rails == 0
    for bad in ("rails: -1\n", "rails: yes\n", "rails: eight\n"):
        with pytest.raises(FabricError, match="rails must be"):
            parse_fabric_yaml(RAIL_YAML.replace("rails: 8\n", bad))


def test_aligned_hops_stay_on_their_rails_and_misaligned_ones_change_rail():
    fabric = parse_fabric_yaml(RAIL_YAML)
    aligned = ring_cost(gang(("n0", (0, 1, 2, 3)), ("n1", (0, 1, 2, 3))), fabric)
    assert (aligned.rails, aligned.rail_changes, aligned.leaf_crossings, aligned.leaves) == ((0, 1, 2, 3), 0, 0, 1)
    crossed = ring_cost(gang(("n0", (0, 1, 2, 3)), ("n1", (4, 5, 6, 7))), fabric)
    assert crossed.rail_changes == 2  # n0 -> n1 and the wrap-around n1 -> n0 both change rail
    assert crossed.rails == tuple(range(8))
    # the same placement on a classic tree: one leaf switch, nothing to change
    tree = default_fabric([f"n{i}" for i in range(8)], nodes_per_leaf=4)
    plain = ring_cost(gang(("n0", (0, 1, 2, 3)), ("n1", (4, 5, 6, 7))), tree)
    assert (plain.rails, plain.rail_changes) == ((), 0)


def test_ring_hops_between_units_cross_leaves_not_rails():
    fabric = parse_fabric_yaml(RAIL_YAML)
    cost = ring_cost(
        gang(("n0", tuple(range(8))), ("n1", tuple(range(8))), ("n4", tuple(range(8))), tier="spine"), fabric
    )
    assert (cost.leaves, cost.leaf_crossings, cost.spine_crossings, cost.rail_changes) == (2, 2, 0, 0)


def test_one_node_has_no_inter_node_hops():
    fabric = parse_fabric_yaml(RAIL_YAML)
    cost = ring_cost(gang(("n0", (0, 1)), ("n0", (2, 3)), tier="node"), fabric)
    assert (cost.leaves, cost.leaf_crossings, cost.spine_crossings, cost.rails, cost.rail_changes) == (1, 0, 0, (), 0)


def test_placement_keeps_rails_aligned_on_partly_used_nodes():
    # n0 has GPUs 0-1 busy, n1 GPU 7: alone, each would take its own best block (4-7 on n0, 0-3 on n1) and every
    # channel would change rail; placed together they take the same indices (2-5) on both.
    fabric = parse_fabric_yaml(RAIL_YAML)
    full = {f"n{i}": set(range(8)) for i in range(2, 8)}
    cap = capacity(fabric, used={"n0": {0, 1}, "n1": {7}, **full})
    p = place_gang(cap, GangRequest("g", 2, 4, required_tier="leaf"), fabric.tiers)
    assert isinstance(p, Placement) and {r.node for r in p.replicas} == {"n0", "n1"}
    assert [r.gpus for r in p.replicas] == [(2, 3, 4, 5), (2, 3, 4, 5)]
    assert ring_cost(p, fabric).rail_changes == 0


def test_phalanx_place_reports_rails_on_a_rail_optimized_fabric(tmp_path, capsys):
    import json

    from phalanx.cli.main import main

    (tmp_path / "fabric.yaml").write_text(RAIL_YAML)
    (tmp_path / "req.jsonl").write_text(
        json.dumps({"name": "g", "replicas": 2, "gpus_per_replica": 8, "required_tier": "leaf"}) + "\n"
    )
    argv = [
        "place",
        "--fabric",
        str(tmp_path / "fabric.yaml"),
        "--profile",
        "dgx-h100",
        "--requests",
        str(tmp_path / "req.jsonl"),
    ]
    assert main([*argv, "--json"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["cost"] == {
        "tier": "leaf",
        "leaves": 1,
        "leaf_crossings": 0,
        "spine_crossings": 0,
        "rails": list(range(8)),
        "rail_changes": 0,
    }
    assert main(argv) == 0
    assert "rails=0,1,2,3,4,5,6,7 rail_changes=0" in capsys.readouterr().out
