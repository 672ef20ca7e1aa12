"""The bounds of the exact placement search: a time budget (`placement_budget_ms`) and a work bound in DP cells.

Within both, the search is exact (the same placement as with no bound at all). Past either it keeps its heuristic
fill where it stopped: still the lowest tier and the fewest children (both read from the index, never from the
DP), only the lower levels may use more domains than needed; and the placement's reason says so. The budget reaches
placement through DecideConfig (the scheduler's --placement-budget-ms) and the capacity view it plans on.
"""

from __future__ import annotations

import random
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.capacity import PLACEMENT_BUDGET_MS, ClusterCapacity, domain_key
from phalanx.core.decide import DecideConfig, PendingJob, Snapshot, decide
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import budget, cover, place_gang

UNBOUNDED = {"budget_ms": 0.0, "cells": 10**18}
# Gangs of 1, 2 and 4 GPUs per replica on partly used nodes: nodes hold several replicas, so the knapsack over
# spines, leaves and nodes runs, with tens of thousands of DP cells each.
LARGE = [(600, 1), (300, 2), (150, 4), (1200, 1)]


def fragmented(seed: int = 3, nodes: int = 512, gpu_model: str = "") -> tuple[ClusterCapacity, tuple[str, ...]]:
    """512 nodes x 8 GPUs, 16 per leaf, 8 leaves per spine (4 spines), each node with a random number used."""
    rng = random.Random(seed)
    names = [f"n{i:03d}" for i in range(nodes)]
    fabric = default_fabric(names, nodes_per_leaf=16, leaves_per_spine=8)
    cap = ClusterCapacity(
        NodeCapacity(n, 8, set(range(rng.choice([0, 2, 3, 5, 6, 7, 8]), 8)), True, fabric.path(n), gpu_model=gpu_model)
        for n in names
    )
    return cap, fabric.tiers


def vector(cap: ClusterCapacity, p: Placement) -> tuple[int, ...]:
    """(lowest level one domain of which holds the gang, then the domains it uses at each level below)."""
    top = cap.levels()
    nodes = [cap.nodes[n] for n in p.nodes]
    for level in range(top + 1):
        if len({domain_key(n, level, top) for n in nodes}) == 1:
            return (level, *(len({domain_key(n, lv, top) for n in nodes}) for lv in range(level - 1, -1, -1)))
    raise AssertionError("the cluster is one domain")


def valid(cap: ClusterCapacity, p: Placement, replicas: int, g: int) -> None:
    assert len(p.replicas) == replicas
    used = [(r.node, gpu) for r in p.replicas for gpu in r.gpus]
    assert len(used) == len(set(used)) == replicas * g
    assert all(set(r.gpus) <= cap.nodes[r.node].free for r in p.replicas)


@pytest.mark.parametrize(("replicas", "g"), LARGE)
def test_within_its_bounds_the_search_is_exact_and_says_nothing(replicas, g):
    cap, tiers = fragmented()
    request = GangRequest("j", replicas, g)
    best = place_gang(cap, request, tiers, **UNBOUNDED)
    got = place_gang(cap, request, tiers, budget_ms=60_000.0)  # the default work bound, time enough on any machine
    assert isinstance(best, Placement) and isinstance(got, Placement)
    assert got == best
    assert "exact search" not in got.reason


@pytest.mark.parametrize(("replicas", "g"), LARGE)
def test_a_search_stopped_by_its_time_budget_says_so_and_keeps_the_tier_and_the_fewest_children(replicas, g):
    cap, tiers = fragmented()
    request = GangRequest("j", replicas, g)
    best = place_gang(cap, request, tiers, **UNBOUNDED)
    with patch.object(budget, "_CLOCK_EVERY", 1):  # read the clock at the first DP cell: stop there
        got = place_gang(cap, request, tiers, budget_ms=1e-9)
    assert isinstance(best, Placement) and isinstance(got, Placement)
    valid(cap, got, replicas, g)
    assert "(exact search stopped at its 1e-09 ms budget: heuristic fill" in got.reason
    have, want = vector(cap, got), vector(cap, best)
    assert have[:2] == want[:2] and (got.tier, got.domains) == (best.tier, best.domains)
    assert have >= want  # no better than the exact search, and on these cases worse
    assert have > want


@pytest.mark.parametrize(("replicas", "g"), LARGE)
def test_past_its_work_bound_the_search_says_so_too(replicas, g):
    cap, tiers = fragmented()
    request = GangRequest("j", replicas, g)
    best = place_gang(cap, request, tiers, **UNBOUNDED)
    got = place_gang(cap, request, tiers, budget_ms=0.0, cells=1000)
    assert isinstance(best, Placement) and isinstance(got, Placement)
    valid(cap, got, replicas, g)
    assert "(exact search past its bound of 1,000 DP cells: heuristic fill" in got.reason
    assert vector(cap, got)[:2] == vector(cap, best)[:2]
    assert vector(cap, got) >= vector(cap, best)
    # deterministic: the same bound gives the same placement every time
    assert place_gang(cap, request, tiers, budget_ms=0.0, cells=1000) == got


def test_the_capacity_views_budget_is_the_default_and_copies_keep_it():
    cap, tiers = fragmented(gpu_model="H100")
    assert cap.placement_budget_ms == PLACEMENT_BUDGET_MS > 0
    cap.placement_budget_ms = 1e-9
    assert cap.copy().placement_budget_ms == 1e-9
    assert cap.restricted("h100").placement_budget_ms == 1e-9
    with patch.object(budget, "_CLOCK_EVERY", 1):
        by_view = place_gang(cap, GangRequest("j", 600, 1, gpu_model="H100"), tiers)  # None: the view's budget
    assert "stopped at its 1e-09 ms budget" in by_view.reason


def test_decide_plans_with_the_configured_budget():
    cap, tiers = fragmented()
    pending = [PendingJob(GangRequest("j", 600, 1))]
    with patch.object(budget, "_CLOCK_EVERY", 1):
        plan = decide(
            Snapshot(
                capacity=cap, pending=pending, running={}, config=DecideConfig(tiers=tiers, placement_budget_ms=1e-9)
            ),
            0.0,
        )
    assert cap.placement_budget_ms == 1e-9
    (reserve,) = plan.steps
    assert "stopped at its 1e-09 ms budget" in reserve.reason
    cap2, _ = fragmented()
    # The default budget, on a clock that stands still: the search cannot run out of it however loaded this machine
    # is (the real clock made this wall-time dependent: a stall over 50 ms failed it), so it ends exact.
    with patch.object(budget, "perf_counter", lambda: 0.0):
        plan = decide(Snapshot(capacity=cap2, pending=pending, running={}, config=DecideConfig(tiers=tiers)), 0.0)
    assert cap2.placement_budget_ms == PLACEMENT_BUDGET_MS
    assert "exact search" not in plan.steps[0].reason


options_lists = st.lists(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 10**14)), min_size=1, max_size=4),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 280), options=options_lists)
def test_the_array_dp_computes_exactly_what_the_list_dp_computes(n, options):
    """`_cover` runs on numpy arrays from `_NUMPY_FROM` replicas on, on lists below: the same integers."""
    with patch.object(cover, "_NUMPY_FROM", 10**9):
        lists = cover._cover(options, n)
    with patch.object(cover, "_NUMPY_FROM", 0):
        arrays = cover._cover(options, n)
    assert lists is not None and arrays is not None and len(lists) == len(arrays)
    for a, b in zip(lists, arrays, strict=True):
        assert [cover._INT_NEVER if x == float("inf") else int(x) for x in a] == b.tolist()
