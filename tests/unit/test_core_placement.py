"""The pure placement core: all-or-nothing gangs, lowest common switch, best fit, strict queue order."""

from __future__ import annotations

from unittest.mock import patch

import pytest
from helpers.placement_baselines import place_replicas_one_by_one, schedule_in_order
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import CapacityError, ClusterCapacity
from phalanx.core.fabric import Fabric, default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, domain_of, pick_gpus, place_gang
from phalanx.core.placement import budget as placement_budget
from phalanx.core.placement import search as placement_search
from phalanx.core.placement.search import _take, _take_indexed


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


def test_crossing_the_cluster_it_weighs_the_leaves_below_the_spines():
    """spine0: two leaves of one 4-GPU node each; spine1: one leaf with an 8-GPU node. 3 x 4 GPUs crosses the
    cluster on 2 spines either way; filling spine0 whole would take 3 leaves, n2 + one of spine0 takes 2."""
    fabric = default_fabric(["n0", "n1", "n2"], nodes_per_leaf=1, leaves_per_spine=2)
    cap = ClusterCapacity(
        NodeCapacity(name, gpus, set(range(gpus)), True, fabric.path(name))
        for name, gpus in (("n0", 4), ("n1", 4), ("n2", 8))
    )
    p = place_gang(cap, GangRequest("j", 3, 4), fabric.tiers)
    assert p.tier == "cluster" and p.domains == 2
    assert set(p.nodes) in ({"n0", "n2"}, {"n1", "n2"})


def test_inside_a_spine_it_weighs_the_nodes_below_the_leaves():
    """Two leaves of two nodes, each leaf one empty node and one half-used: 4 x 4 GPUs needs the spine and 2 leaves
    either way; filling one leaf whole would take 3 nodes, the two empty nodes take 2."""
    cap, tiers = cluster(nodes=4, per_leaf=2, used={"n1": 4, "n3": 4})
    p = place_gang(cap, GangRequest("j", 4, 4), tiers)
    assert p.tier == "spine" and p.domains == 2
    assert set(p.nodes) == {"n0", "n2"}


def test_the_lowest_tier_comes_before_the_fewest_leaves_anywhere():
    """spine0 holds 6 x 8 GPUs on 6 leaves (one free node each); three other spines hold 2 nodes on one leaf each.
    3 leaves would do across the cluster, but the gang stays under spine0: the lowest tier first."""
    full = {f"n{i}": 8 for i in range(0, 12, 2)}  # spine0: every leaf keeps one free node
    full |= {f"n{i}": 8 for i in range(12, 48) if i % 12 >= 2}  # spines 1-3: only their first leaf is free
    fabric = default_fabric([f"n{i}" for i in range(48)], nodes_per_leaf=2, leaves_per_spine=6)
    cap = ClusterCapacity(
        NodeCapacity(name, 8, set(range(full.get(name, 0), 8)), True, fabric.path(name)) for name in fabric.paths
    )
    p = place_gang(cap, GangRequest("j", 6, 8), fabric.tiers)
    assert p.tier == "spine" and p.domains == 6
    assert {cap.nodes[n].path[1] for n in p.nodes} == {"spine0"}


def test_an_empty_uniform_cluster_needs_no_dp():
    """Empty and uniform: filling the fullest children first reaches the lower bound at every level, so no knapsack
    is ever run (the fast path), whatever the gang."""
    paths = {f"n{i:02d}": (f"leaf{i // 4}", f"spine{i // 16}", f"core{i // 32}") for i in range(64)}
    fabric = Fabric(tiers=("leaf", "spine", "core"), paths=paths)
    for g in (1, 2, 3, 4, 8):
        for replicas in (1, 3, 5, 9, 17, 33, 40, 64):
            cap = ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True, fabric.path(n)) for n in sorted(paths))
            with patch.object(placement_search, "_cover", side_effect=AssertionError("the DP ran")):
                p = place_gang(cap, GangRequest("j", replicas, g), fabric.tiers)
            if replicas * g <= 512:
                assert isinstance(p, Placement)
                assert len(p.nodes) == -(-replicas // (8 // g))


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
    ops=st.lists(
        st.tuples(
            st.sampled_from(["take", "release", "drain", "undrain"]),
            st.integers(0, 9),
            st.sets(st.integers(0, 7), max_size=8),
        ),
        max_size=40,
    ),
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
            best = min(fits, key=lambda n: tightest_key(cap, effective, n)) if fits else None
            assert cap.tightest_node(want) is best


def tightest_key(cap: ClusterCapacity, effective: dict[str, int], node: NodeCapacity) -> tuple:
    """The reference order of `tightest_node`, by scanning: fewest free GPUs, then (fragmentation) the fullest
    domain of the lowest switch tier that groups several nodes, then that domain's name, then the node's."""
    depth = cap.levels() - 1
    tie = next(
        (
            lv
            for lv in range(1, depth + 1)
            if max(sum(1 for n in cap.nodes.values() if n.path[lv - 1] == m.path[lv - 1]) for m in cap.nodes.values())
            > 1
        ),
        0,
    )
    if not tie:
        return (effective[node.name], node.name)
    domain = node.path[tie - 1]
    fullness = sum(effective[n.name] for n in cap.nodes.values() if n.path[tie - 1] == domain)
    return (effective[node.name], fullness, domain, node.name)


# ---- GPU choice within a node: rail alignment and contiguous blocks ------------------------------------------


def test_rail_alignment_gives_every_node_of_a_gang_the_same_gpu_indices():
    cap, tiers = cluster(nodes=4, per_leaf=4)
    cap.take("n0", {0, 1})
    cap.take("n1", {6, 7})
    cap.take("n2", {0, 7})
    cap.take("n3", {1, 6})
    p = place_gang(cap, GangRequest("j", 4, 4), tiers)
    assert isinstance(p, Placement) and len(p.nodes) == 4
    # free on every node: 2-5, so local rank i uses GPU 2+i (rail 2+i) on every node
    assert {r.gpus for r in p.replicas} == {(2, 3, 4, 5)}
    cap.reserve(p)


def test_rail_alignment_falls_back_to_each_nodes_own_gpus_when_no_common_set_exists():
    cap, tiers = cluster(nodes=2, per_leaf=2)
    cap.take("n0", {0, 1, 2, 3})
    cap.take("n1", {4, 5, 6, 7})
    p = place_gang(cap, GangRequest("j", 2, 4), tiers)
    assert {r.node: r.gpus for r in p.replicas} == {"n0": (4, 5, 6, 7), "n1": (0, 1, 2, 3)}


def test_gpus_within_a_node_come_in_aligned_contiguous_blocks():
    cap, tiers = cluster(nodes=1)
    cap.take("n0", {0, 1})
    p = place_gang(cap, GangRequest("j", 1, 4), tiers)
    assert p.replicas[0].gpus == (4, 5, 6, 7)  # one half, not 2-5
    cap.reserve(p)
    q = place_gang(cap, GangRequest("k", 1, 2), tiers)
    assert q.replicas[0].gpus == (2, 3)


def test_pick_gpus_prefers_aligned_then_contiguous_then_lowest():
    assert pick_gpus({1, 2, 3, 4, 5, 6, 7}, 4) == (4, 5, 6, 7)
    assert pick_gpus({1, 2, 3, 5, 7}, 2) == (2, 3)
    assert pick_gpus({1, 2, 3, 5, 7}, 3) == (1, 2, 3)
    assert pick_gpus({0, 2, 4, 6}, 2) == (0, 2)


# ---- per-replica mode (no gang semantics) --------------------------------------------------------------------


def test_one_by_one_keeps_a_partial_gang_and_two_gangs_can_deadlock():
    cap, _ = cluster(nodes=4, per_leaf=4)
    a, b = GangRequest("a", 3, 8), GangRequest("b", 3, 8)
    held_a: tuple = ()
    held_b: tuple = ()
    for _ in range(3):  # interleaved, one replica each per turn, like two controllers racing
        held_a = place_replicas_one_by_one(cap, a, held_a, limit=1)
        held_b = place_replicas_one_by_one(cap, b, held_b, limit=1)
    assert len(held_a) == 2 and len(held_b) == 2  # both partial, neither complete, nothing left
    assert cap.free_gpus() == 0
    assert [r.replica for r in held_a] == [0, 1]
    assert not {r.node for r in held_a} & {r.node for r in held_b}
    # gang scheduling would have placed one of them whole and kept the other waiting holding nothing
    cap2, tiers = cluster(nodes=4, per_leaf=4)
    placed, blocked = schedule_in_order(cap2, [a, b], tiers)
    assert [p.job_id for p in placed] == ["a"] and blocked is not None and blocked.job_id == "b"


def test_one_by_one_without_limit_takes_the_best_fit_nodes():
    cap, _ = cluster(nodes=3, per_leaf=3, used={"n1": 6})
    got = place_replicas_one_by_one(cap, GangRequest("j", 2, 2), ())
    assert [(r.node, r.gpus) for r in got] == [("n1", (6, 7)), ("n0", (0, 1))]
    assert cap.nodes["n1"].free == set() and cap.nodes["n0"].free == set(range(2, 8))


# ---- the index walk equals the scan --------------------------------------------------------------------------


def three_tiers(nodes: int, per_leaf: int, per_spine: int, per_core: int) -> Fabric:
    paths = {}
    for i in range(nodes):
        leaf = i // per_leaf
        spine = leaf // per_spine
        paths[f"n{i}"] = (f"leaf{leaf}", f"spine{spine}", f"core{spine // per_core}")
    return Fabric(tiers=("leaf", "spine", "core"), paths=paths)


take_cases = dict(
    nodes=st.integers(1, 24),
    per_leaf=st.integers(1, 4),
    per_spine=st.integers(1, 3),
    per_core=st.integers(0, 3),  # 0: two tiers (leaf, spine)
    used=st.lists(st.integers(0, 8), min_size=24, max_size=24),
    replicas=st.integers(1, 12),
    g=st.sampled_from([1, 2, 4, 8]),
)


def indexed_vs_scan(nodes, per_leaf, per_spine, per_core, used, replicas, g) -> None:
    names = [f"n{i}" for i in range(nodes)]
    fabric = (
        three_tiers(nodes, per_leaf, per_spine, per_core)
        if per_core
        else default_fabric(names, nodes_per_leaf=per_leaf, leaves_per_spine=per_spine)
    )
    cap = ClusterCapacity(
        NodeCapacity(f"n{i}", 8, set(range(used[i], 8)), True, fabric.path(f"n{i}")) for i in range(nodes)
    )
    for level in range(1, cap.levels() + 1):
        stats = cap.domain_stats(level, g)
        for key, (slots, _) in stats.items():
            if slots < replicas:
                continue
            members = [n for n in cap.members(level, key) if n.schedulable and len(n.free) >= g]
            scan = [(n.name, c) for n, c in _take(members, replicas, g, level)]
            indexed = [(n.name, c) for n, c in _take_indexed(cap, level, key, replicas, g)]
            assert indexed == scan
            assert sum(c for _, c in scan) == replicas
            assert all(c <= cap.nodes[n].slots(g) for n, c in scan)
            # the fewest children, whether the DP ran or not
            children = sorted((s for s, _ in cap.child_stats(level, key, g).values()), reverse=True)
            fewest = next(i + 1 for i in range(len(children)) if sum(children[: i + 1]) >= replicas)
            assert len({domain_of(cap.nodes[n], level - 1) for n, _ in scan}) == fewest


@settings(max_examples=80, deadline=None)
@given(**take_cases)
def test_the_indexed_take_chooses_what_the_scan_take_chooses(nodes, per_leaf, per_spine, per_core, used, replicas, g):
    indexed_vs_scan(nodes, per_leaf, per_spine, per_core, used, replicas, g)


@settings(max_examples=60, deadline=None)
@given(**take_cases)
def test_the_greedy_fallback_is_consistent_too(nodes, per_leaf, per_spine, per_core, used, replicas, g):
    """With no room for any DP (what a huge gang on a huge fabric gets), both takes fall back to the same greedy:
    still the fewest children, still valid."""
    with patch.object(placement_budget, "_EXACT_CELLS", 0):
        indexed_vs_scan(nodes, per_leaf, per_spine, per_core, used, replicas, g)


def test_equal_nodes_are_decided_by_fragmentation_keeping_emptier_leaves_whole():
    # x1 (leaf0) and a1 (leaf1) both have exactly 4 free GPUs; by name a1 would win. leaf0 is the fuller leaf
    # (x2 is busy), so the job goes to x1 and leaf1 keeps a whole free node (a2) beside a1's 4 GPUs.
    paths = {"x1": ("leaf0", "spine0"), "x2": ("leaf0", "spine0"), "a1": ("leaf1", "spine0"), "a2": ("leaf1", "spine0")}
    free = {"x1": {4, 5, 6, 7}, "x2": set(), "a1": {4, 5, 6, 7}, "a2": set(range(8))}
    cap = ClusterCapacity(NodeCapacity(n, 8, set(free[n]), True, paths[n]) for n in paths)
    p = place_gang(cap, GangRequest("j", 1, 4), ("leaf", "spine"))
    assert p.replicas[0].node == "x1"
    # one node per leaf: the spines group the nodes, so the fuller spine decides
    paths2 = {"s0a": ("l0", "sp0"), "s0b": ("l1", "sp0"), "s1a": ("l2", "sp1"), "s1b": ("l3", "sp1")}
    free2 = {"s0a": {0, 1}, "s0b": set(range(8)), "s1a": {0, 1}, "s1b": set()}
    cap2 = ClusterCapacity(NodeCapacity(n, 8, set(free2[n]), True, paths2[n]) for n in paths2)
    assert place_gang(cap2, GangRequest("k", 1, 2), ("leaf", "spine")).replicas[0].node == "s1a"
