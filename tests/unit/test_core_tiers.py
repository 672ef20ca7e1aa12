"""Required and preferred tiers (Kueue TAS style) in the pure placement core."""

from __future__ import annotations

from helpers.placement_baselines import schedule_in_order

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import Unplaceable, place_gang


def cluster(nodes: int = 8, gpus: int = 8, per_leaf: int = 2, per_spine: int = 2, full: tuple[str, ...] = ()):
    fabric = default_fabric([f"n{i}" for i in range(nodes)], nodes_per_leaf=per_leaf, leaves_per_spine=per_spine)
    cap = ClusterCapacity(
        NodeCapacity(name, gpus, set() if name in full else set(range(gpus)), True, fabric.path(name))
        for name in fabric.paths
    )
    return cap, fabric.tiers


def free_map(cap):
    return {n: set(c.free) for n, c in cap.nodes.items()}


def test_required_leaf_is_satisfied_under_one_leaf():
    cap, tiers = cluster()
    p = place_gang(cap, GangRequest("j", 2, 8, required_tier="leaf"), tiers)
    assert isinstance(p, Placement) and p.tier == "leaf"
    assert len({cap.nodes[n].path[0] for n in p.nodes}) == 1


def test_required_tier_refuses_a_gang_that_would_cross_it_and_reserves_nothing():
    cap, tiers = cluster()  # leaves of 2 nodes: 4 x 8 needs a spine
    before = free_map(cap)
    result = place_gang(cap, GangRequest("j", 4, 8, required_tier="leaf"), tiers)
    assert isinstance(result, Unplaceable)
    assert result.reason == "needs 4 x 8 GPUs under one leaf (required_tier); the best leaf holds 2 such replica(s) now"
    assert free_map(cap) == before
    # without the requirement it crosses the leaf tier
    assert place_gang(cap, GangRequest("j", 4, 8), tiers).tier == "spine"


def test_required_tier_counts_what_is_free_now():
    cap, tiers = cluster(full=("n0", "n2", "n4"))  # every leaf but the last has one free node
    p = place_gang(cap, GangRequest("j", 2, 8, required_tier="leaf"), tiers)
    assert set(p.nodes) == {"n6", "n7"}
    cap.reserve(p)
    r = place_gang(cap, GangRequest("k", 2, 8, required_tier="leaf"), tiers)
    assert isinstance(r, Unplaceable) and "the best leaf holds 1 such replica(s) now" in r.reason


def test_required_node_and_spine_and_cluster():
    cap, tiers = cluster(gpus=4)
    assert place_gang(cap, GangRequest("a", 2, 2, required_tier="node"), tiers).tier == "node"
    r = place_gang(cap, GangRequest("b", 3, 2, required_tier="node"), tiers)
    assert isinstance(r, Unplaceable) and "under one node" in r.reason and "holds 2 such" in r.reason
    assert place_gang(cap, GangRequest("c", 4, 4, required_tier="spine"), tiers).tier == "spine"
    assert isinstance(place_gang(cap, GangRequest("d", 5, 4, required_tier="spine"), tiers), Unplaceable)
    assert place_gang(cap, GangRequest("e", 5, 4, required_tier="cluster"), tiers).tier == "cluster"


def test_unknown_required_tier_is_unplaceable_with_a_clear_reason():
    cap, tiers = cluster()
    r = place_gang(cap, GangRequest("j", 1, 1, required_tier="rack"), tiers)
    assert isinstance(r, Unplaceable)
    assert r.reason == "unknown required_tier 'rack'; this cluster has node, leaf, spine, cluster"


def test_preferred_tier_is_met_when_one_domain_fits():
    cap, tiers = cluster()
    p = place_gang(cap, GangRequest("j", 2, 8, preferred_tier="leaf"), tiers)
    assert p.tier == "leaf" and "preferred" not in p.reason


def test_preferred_tier_falls_back_to_the_lowest_tier_that_fits():
    cap, tiers = cluster(nodes=8)
    p = place_gang(cap, GangRequest("j", 4, 8, preferred_tier="leaf"), tiers)
    assert isinstance(p, Placement) and p.tier == "spine"  # not the cluster: spine is the lowest that fits
    assert "no single leaf (preferred_tier) holds it now" in p.reason
    q = place_gang(cap, GangRequest("k", 6, 8, preferred_tier="leaf"), tiers)
    assert q.tier == "cluster"


def test_refused_head_still_stops_the_queue_and_nothing_is_reserved():
    cap, tiers = cluster()
    before = free_map(cap)
    pending = [
        GangRequest("wide", 4, 8, required_tier="leaf", submitted_at=1),
        GangRequest("small", 1, 1, submitted_at=2),
    ]
    placed, blocked = schedule_in_order(cap, pending, tiers)
    assert placed == [] and blocked is not None and blocked.job_id == "wide"
    assert free_map(cap) == before


def test_a_placed_required_gang_lets_the_queue_go_on():
    cap, tiers = cluster()
    pending = [GangRequest("a", 2, 8, required_tier="leaf", submitted_at=1), GangRequest("b", 1, 1, submitted_at=2)]
    placed, blocked = schedule_in_order(cap, pending, tiers)
    assert [p.job_id for p in placed] == ["a", "b"] and blocked is None


def test_a_fabric_tier_deeper_than_the_nodes_is_the_whole_cluster():
    cap = ClusterCapacity(NodeCapacity(f"n{i}", 8, set(range(8))) for i in range(3))
    p = place_gang(cap, GangRequest("j", 3, 8, required_tier="leaf"), ("leaf", "spine"))
    assert isinstance(p, Placement) and len(p.nodes) == 3
