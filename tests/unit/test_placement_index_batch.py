"""The capacity index after large reservations (which update it once for all their nodes) reads exactly like an
index built from scratch over the same nodes, and placement on it decides the same."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang


def fresh_copy(cap: ClusterCapacity) -> ClusterCapacity:
    return cap.copy()  # a new index, built from the nodes as they are now


def same_reads(a: ClusterCapacity, b: ClusterCapacity) -> None:
    top = a.levels()
    assert top == b.levels()
    for g in (1, 2, 3, 4, 8):
        for level in range(1, top + 1):
            assert a.domain_stats(level, g) == b.domain_stats(level, g)
            for key in a.domain_stats(level, g):
                assert a.child_stats(level, key, g) == b.child_stats(level, key, g)
                assert a.node_slots(level, key, g) == b.node_slots(level, key, g)
        for k in range(0, 9):
            x, y = a.tightest_node(k), b.tightest_node(k)
            assert (x and x.name) == (y and y.name)
    assert a.free_gpus() == b.free_gpus()
    assert a.unschedulable() == b.unschedulable()
    assert a.most_free_on_a_node() == b.most_free_on_a_node()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    nodes=st.sampled_from([24, 64, 96]),
    per_leaf=st.sampled_from([4, 8]),
    steps=st.integers(5, 30),
)
def test_large_reservations_leave_the_index_as_a_fresh_build_would(seed, nodes, per_leaf, steps):
    rng = random.Random(seed)
    names = [f"n{i:03d}" for i in range(nodes)]
    fabric = default_fabric(names, nodes_per_leaf=per_leaf, leaves_per_spine=3)
    cap = ClusterCapacity(
        NodeCapacity(n, 8, set(range(rng.choice([0, 0, 2, 5, 8]), 8)), rng.random() > 0.05, fabric.path(n))
        for n in names
    )
    cap.levels()
    held: list[Placement] = []
    for i in range(steps):
        if held and rng.random() < 0.35:
            cap.release_placement(held.pop(rng.randrange(len(held))))
        else:
            g = rng.choice([1, 2, 4, 8])
            replicas = rng.choice([1, 3, 9, 16, 40]) * (8 // g)
            p = place_gang(cap, GangRequest(f"j{i}", replicas, g), fabric.tiers)
            if isinstance(p, Placement):
                twin = fresh_copy(cap)
                assert place_gang(twin, GangRequest(f"j{i}", replicas, g), fabric.tiers) == p
                cap.reserve(p)
                held.append(p)
        same_reads(cap, fresh_copy(cap))
