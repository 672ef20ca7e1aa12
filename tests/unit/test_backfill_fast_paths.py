"""The scheduling pass's fast paths (phalanx/core/backfill.py, phalanx/core/capacity.py) decide exactly as the plain
ones: running gangs given as a `RunningSet` (kept in end order) against a plain list, and the reservation search done
on the live capacity (put back as it was) against one on a copy."""

from __future__ import annotations

import random

from phalanx.core.backfill import RunningEnd, RunningSet, plan_reservation, schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang


def cluster(nodes: int, per_leaf: int, gpus: int = 8):
    fabric = default_fabric([f"n{i:03d}" for i in range(nodes)], nodes_per_leaf=per_leaf, leaves_per_spine=4)
    cap = ClusterCapacity(NodeCapacity(n, gpus, set(range(gpus)), True, fabric.path(n)) for n in fabric.paths)
    return cap, fabric.tiers


def index_of(cap: ClusterCapacity):
    """Everything placement reads, as plain values (a rebuilt index must read the same)."""
    cap._ensure()
    return (
        {n.name: (sorted(n.free), dict(n.mig), dict(n.milli), n.schedulable) for n in cap.nodes.values()},
        [dict(h) for h in cap._hist],
        [list(b) for b in cap._by_free],
        dict(cap._effective),
        [dict(d) for d in cap._dom_free],
        [set(s) for s in cap._leaves_with],
        {k: [list(b) for b in v] for k, v in cap._tie_buckets.items()},
        cap.unschedulable(),
        [cap.domain_stats(lv, g) for lv in range(1, cap.levels() + 1) for g in (1, 2, 4, 8)],
    )


def busy_cluster(seed: int, topology: bool = True):
    rng = random.Random(seed)
    cap, tiers = cluster(64, per_leaf=8)
    if not topology:
        cap = ClusterCapacity(NodeCapacity(n.name, 8, set(range(8))) for n in cap.nodes.values())
        tiers = ()
    running = []
    for i in range(200):
        r, g = rng.choice([(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (1, 1), (1, 1)])
        got = place_gang(cap, GangRequest(f"r{i}", r, g), tiers)
        if isinstance(got, Placement):
            cap.reserve(got)
            running.append(RunningEnd(f"r{i}", got, float(rng.choice([50, 100, 100, 200, 300, 400, 1e9]))))
    for name in rng.sample(sorted(cap.nodes), 3):
        cap.set_schedulable(name, False)
    return cap, tiers, running, rng


def test_reservation_is_the_same_from_a_running_set_and_leaves_the_capacity_as_it_was():
    for seed in range(12):
        for topology in (True, False):
            cap, tiers, running, rng = busy_cluster(seed, topology)
            before = index_of(cap)
            for head in (
                GangRequest("h", 4, 8),
                GangRequest("h", 16, 4),
                GangRequest("h", 1, 8),
                GangRequest("h", 24, 8),
            ):
                shuffled = running[:]
                rng.shuffle(shuffled)
                plain = plan_reservation(cap.copy(), head, shuffled, 10.0, tiers)
                fast = plan_reservation(cap, head, RunningSet(shuffled), 10.0, tiers)
                assert fast == plain
                assert index_of(cap) == before
                # The index after the search reads as one built afresh from the same nodes.
                assert index_of(cap) == index_of(cap.copy())


def test_a_reservation_search_started_from_the_last_answer_finds_the_same_in_fewer_placements(monkeypatch):
    """plan_reservation's `hints`: the search starts where the last one of the same head ended. From one cycle to
    the next a few gangs end and others start; the answer must be the cold search's, and cost fewer placements."""
    from phalanx.core import reservation

    calls = {"n": 0}
    real = reservation.place_gang

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(reservation, "place_gang", counted)
    warm_calls = cold_calls = 0
    for seed in range(6):
        cap, tiers, running, rng = busy_cluster(seed)
        hints: dict = {}
        for head in (GangRequest("h", 4, 8), GangRequest("h", 24, 8), GangRequest("h2", 1, 8)):
            for _ in range(6):  # cycles: a gang ends, another takes its place with a new end
                ended = running.pop(rng.randrange(len(running)))
                cap.release_placement(ended.placement)
                got = real(cap, GangRequest(f"n{len(running)}-{rng.random()}", 1, rng.choice([1, 2, 4])), tiers)
                if isinstance(got, Placement):
                    cap.reserve(got)
                    running.append(RunningEnd(got.job_id, got, float(rng.choice([60, 150, 250, 350]))))
                calls["n"] = 0
                cold = plan_reservation(cap.copy(), head, running, 10.0, tiers)
                cold_calls += calls["n"]
                calls["n"] = 0
                warm = plan_reservation(cap, head, RunningSet(running), 10.0, tiers, hints=hints)
                warm_calls += calls["n"]
                assert warm == cold
    assert warm_calls < cold_calls * 0.75, (warm_calls, cold_calls)


def test_a_pass_decides_the_same_with_a_running_set_and_hides_the_region_only_while_needed():
    for seed in range(8):
        cap, tiers, running, rng = busy_cluster(seed)
        pending = [
            GangRequest(
                f"p{i}",
                *rng.choice([(1, 1), (1, 4), (2, 8), (8, 8), (1, 8)]),
                submitted_at=i,
                time_limit=rng.choice([0, 30, 60, 500]),
            )
            for i in range(60)
        ]
        other = cap.copy()
        plain = schedule_with_backfill(
            other, pending, tiers, now=10.0, running=lambda running=running: running, memo={}
        )
        live = RunningSet(reversed(running))
        fast = schedule_with_backfill(cap, pending, tiers, now=10.0, running=lambda live=live: live, memo={})
        assert fast == plain
        assert index_of(cap) == index_of(other)
        assert not cap.unschedulable() - other.unschedulable()  # every hidden node is shown again


def test_running_set_keeps_end_order_as_gangs_start_and_stop():
    cap, tiers = cluster(8, per_leaf=4)
    p = place_gang(cap, GangRequest("x", 1, 1), tiers)
    live = RunningSet()
    for job, end in [("b", 5.0), ("a", 5.0), ("c", 1.0), ("d", float("inf"))]:
        live.add(RunningEnd(job, p, end))
    assert [g.job_id for g in live] == ["c", "a", "b", "d"]
    version = live.version
    live.discard("a")
    live.add(RunningEnd("b", p, 0.5))  # a gang started again replaces its old entry
    assert [g.job_id for g in live] == ["b", "c", "d"] and "a" not in live and live.version == version + 3
