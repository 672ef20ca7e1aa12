"""The pure placement core: all-or-nothing gangs, lowest common switch, best fit, strict queue order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import CapacityError, ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, place_gang, schedule_in_order


def cluster(nodes: int = 8, gpus: int = 8, per_leaf: int = 4, used: dict[str, int] | None = None):
    fabric = default_fabric([f"n{i}" for i in range(nodes)], nodes_per_leaf=per_leaf)
    cap = ClusterCapacity(
        NodeCapacity(name, gpus, set(range((used or {}).get(name, 0), gpus)), True, fabric.path(name))
        for name in fabric.paths
    )
    return cap, fabric.tiers


def test_a_gang_that_fits_in_one_node_stays_in_the_tightest_node():
    cap, tiers = cluster(used={"n0": 2, "n5": 5})
    p = place_gang(cap, GangRequest("j", 1, 3), tiers)
    assert isinstance(p, Placement) and p.tier == "node"
    assert p.replicas[0].node == "n5" and p.replicas[0].gpus == (5, 6, 7)


def test_multi_node_gang_stays_under_one_leaf_when_one_can_hold_it():
    cap, tiers = cluster(used={"n0": 8, "n1": 8, "n2": 8})  # leaf0 has one free node, leaf1 four
    p = place_gang(cap, GangRequest("j", 2, 8), tiers)
    assert p.tier == "leaf" and set(p.nodes) <= {"n4", "n5", "n6", "n7"}


def test_best_fit_is_global_within_the_tier():
    # leaf0 has 2 free nodes, leaf1 has 4: a 2-node gang takes leaf0 and keeps leaf1 whole.
    cap, tiers = cluster(used={"n0": 8, "n1": 8})
    p = place_gang(cap, GangRequest("j", 2, 8), tiers)
    assert set(p.nodes) == {"n2", "n3"}


def test_a_gang_too_big_for_a_leaf_spans_as_few_leaves_as_possible_in_switch_order():
    cap, tiers = cluster(nodes=12)
    p = place_gang(cap, GangRequest("j", 6, 8), tiers)
    assert p.tier == "spine" and p.domains == 2
    assert list(p.nodes) == sorted(p.nodes, key=lambda n: int(n[1:]))  # ring neighbours share a switch
    assert [r.replica for r in p.replicas] == list(range(6))


def test_unplaceable_says_why_and_changes_nothing():
    cap, tiers = cluster(nodes=2, used={"n0": 4})
    before = {n: set(c.free) for n, c in cap.nodes.items()}
    result = place_gang(cap, GangRequest("j", 2, 8), tiers)
    assert isinstance(result, Unplaceable) and "holds 1 such replica" in result.reason
    assert {n: set(c.free) for n, c in cap.nodes.items()} == before


def test_unschedulable_nodes_are_never_used():
    cap, tiers = cluster(nodes=2)
    cap.set_schedulable("n0", False)
    assert place_gang(cap, GangRequest("j", 1, 8), tiers).nodes == ("n1",)
    assert isinstance(place_gang(cap, GangRequest("k", 2, 8), tiers), Unplaceable)


def test_reserve_is_all_or_nothing():
    cap, _ = cluster(nodes=2)
    bad = Placement("j", (ReplicaPlacement(0, "n0", (0, 1)), ReplicaPlacement(1, "n1", (9,))), "leaf", 2, 0, "")
    with pytest.raises(CapacityError):
        cap.reserve(bad)
    assert all(len(c.free) == 8 for c in cap.nodes.values())


def test_queue_is_served_in_priority_then_submission_order_and_stops_at_the_blocked_head():
    cap, tiers = cluster(nodes=2)
    pending = [
        GangRequest("late-small", 1, 1, priority=0, submitted_at=3),
        GangRequest("big", 2, 8, priority=0, submitted_at=2),
        GangRequest("urgent", 1, 4, priority=9, submitted_at=5),
    ]
    placed, blocked = schedule_in_order(cap, pending, tiers)
    assert [p.job_id for p in placed] == ["urgent"]
    assert blocked is not None and blocked.job_id == "big"  # the small one behind it does not jump ahead


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(1, 12),
    per_leaf=st.integers(1, 5),
    gangs=st.lists(st.tuples(st.integers(1, 5), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=25),
)
def test_placements_never_double_book_and_hold_exactly_what_was_asked(nodes, per_leaf, gangs):
    cap, tiers = cluster(nodes=nodes, per_leaf=per_leaf)
    held: set[tuple[str, int]] = set()
    for i, (replicas, g) in enumerate(gangs):
        free_before = cap.free_gpus()
        leaf_slots: dict[str, int] = {}
        for node in cap.nodes.values():
            leaf_slots[node.path[0]] = leaf_slots.get(node.path[0], 0) + len(node.free) // g
        node_fits = any(len(n.free) // g >= replicas for n in cap.nodes.values())
        result = place_gang(cap, GangRequest(f"j{i}", replicas, g), tiers)
        if isinstance(result, Unplaceable):
            assert sum(leaf_slots.values()) < replicas
            continue
        assert len(result.replicas) == replicas
        for rep in result.replicas:
            assert len(rep.gpus) == g == len(set(rep.gpus))
            for gpu in rep.gpus:
                assert (rep.node, gpu) not in held
                held.add((rep.node, gpu))
        cap.reserve(result)
        assert cap.free_gpus() == free_before - replicas * g
        # the lowest common switch: never cross a tier when a lower domain could hold the whole gang
        if node_fits:
            assert result.tier == "node"
        elif max(leaf_slots.values()) >= replicas:
            assert result.tier == "leaf"


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(1, 10),
    per_leaf=st.integers(1, 4),
    ops=st.lists(st.tuples(st.sampled_from(["take", "release", "drain", "undrain"]), st.integers(0, 9),
                           st.sets(st.integers(0, 7), max_size=8)), max_size=40),
)
def test_the_free_capacity_index_always_matches_a_full_scan(nodes, per_leaf, ops):
    cap, _ = cluster(nodes=nodes, per_leaf=per_leaf)
    for op, i, gpus in ops:
        name = f"n{i % nodes}"
        if op == "take":
            cap.take(name, gpus)
        elif op == "release":
            cap.release(name, gpus)
        else:
            cap.set_schedulable(name, op == "undrain")
        effective = {n.name: (len(n.free) if n.schedulable else 0) for n in cap.nodes.values()}
        assert cap.free_gpus() == sum(effective.values())
        for g in (1, 2, 8):
            for level in range(1, cap.levels() + 1):
                scan: dict[str, tuple[int, int]] = {}
                for n in cap.nodes.values():
                    key = n.path[level - 1] if level < cap.levels() else ""
                    slots, free = scan.get(key, (0, 0))
                    scan[key] = (slots + effective[n.name] // g, free + effective[n.name])
                assert cap.domain_stats(level, g) == scan
        for want in (1, 4, 8):
            fits = [n for n in cap.nodes.values() if effective[n.name] >= want]
            best = min(fits, key=lambda n: (effective[n.name], n.name)) if fits else None
            assert cap.tightest_node(want) is best
