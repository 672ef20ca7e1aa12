"""The fleet plan (phalanx.core.rollout) over random fleets: a rolling update never takes ready replicas below
K - max_unavailable, never runs more than K + max_surge, starts surge replicas only above K, and converges."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.core.rollout import ReplicaView, plan_fleet


def views(n: int, revision: int, ready: bool = True, start: int = 0) -> list[ReplicaView]:
    return [ReplicaView(i, revision, f"r{revision}-{i}", ready=ready) for i in range(start, start + n)]


def test_steady_state_starts_missing_replicas_at_the_lowest_free_indices():
    plan = plan_fleet(views(1, 1, start=1), 3, 1)
    assert [(s.index, s.surge) for s in plan.starts] == [(0, False), (2, False)] and not plan.stops


def test_scaling_down_stops_unready_replicas_first_then_the_highest_indices():
    fleet = views(3, 1) + [ReplicaView(3, 1, "r1-3", ready=False)]
    plan = plan_fleet(fleet, 2, 1)
    assert [s.key for s in plan.stops] == ["r1-3", "r1-2"]


def test_a_down_replica_keeps_its_slot_until_the_next_revision():
    fleet = [*views(1, 1), ReplicaView(1, 1, "dead", down=True)]
    assert not plan_fleet(fleet, 2, 1).starts
    assert [s.index for s in plan_fleet(fleet, 2, 2).starts] == [1]  # a new revision replaces it


def test_max_surge_zero_replaces_one_old_replica_at_a_time():
    plan = plan_fleet(views(3, 1), 3, 2, max_surge=0, max_unavailable=1)
    assert not plan.starts and [s.key for s in plan.stops] == ["r1-2"]
    plan = plan_fleet(views(2, 1), 3, 2, max_surge=0, max_unavailable=1)
    assert [(s.index, s.surge) for s in plan.starts] == [(2, False)] and not plan.stops


def test_surge_replicas_start_above_k_and_old_ones_wait_for_them():
    plan = plan_fleet(views(3, 1), 3, 2, max_surge=1, max_unavailable=0)
    assert [(s.index, s.surge) for s in plan.starts] == [(3, True)] and not plan.stops
    waiting = [*views(3, 1), ReplicaView(3, 2, "new", ready=False)]
    plan = plan_fleet(waiting, 3, 2, max_surge=1, max_unavailable=0)
    assert not plan.starts and not plan.stops and "waits" in plan.message


def simulate(k: int, surge: int, unavailable: int, seed: int, steps: int = 200) -> list[ReplicaView]:
    """Apply plans to a fleet whose replicas become ready (or fail) at random, checking the bounds at each step."""
    rng = random.Random(seed)
    fleet = {f"old{i}": ReplicaView(i, 1, f"old{i}", ready=True) for i in range(k)}
    serial = 0
    for _ in range(steps):
        plan = plan_fleet(list(fleet.values()), k, 2, max_surge=surge, max_unavailable=unavailable)
        ready_before = sum(r.ready for r in fleet.values())
        for stop in plan.stops:
            del fleet[stop.key]
        ready_after = sum(r.ready for r in fleet.values())
        assert ready_after >= min(ready_before, k - unavailable), (plan, fleet)
        for start in plan.starts:
            serial += 1
            assert start.surge == (len(fleet) >= k)
            fleet[f"n{serial}"] = ReplicaView(start.index, 2, f"n{serial}")
        assert len(fleet) <= k + surge
        assert len({r.index for r in fleet.values()}) == len(fleet)  # indices stay distinct
        for key, r in list(fleet.items()):  # the world moves: new replicas come up; rarely one fails and restarts
            if not r.ready and rng.random() < 0.5:
                fleet[key] = ReplicaView(r.index, r.revision, key, ready=True)
            elif r.ready and rng.random() < 0.02:
                fleet[key] = ReplicaView(r.index, r.revision, key, ready=False)
    return list(fleet.values())


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 8),
    surge=st.integers(0, 3),
    unavailable=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_rolling_updates_keep_their_bounds_and_converge(k, surge, unavailable, seed):
    if surge == 0 and unavailable == 0:
        return  # refused by the API: a rollout could never start
    final = simulate(k, surge, unavailable, seed)
    assert all(r.revision == 2 for r in final) and len(final) == k
