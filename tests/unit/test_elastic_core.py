"""Elastic gangs in the pure core: placement takes the most replicas that fit between MIN and MAX, a running gang
grows through the checkpoint handshake, a requeued one restarts smaller (never below MIN)."""

from __future__ import annotations

from dataclasses import replace

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import (
    AskCheckpoint,
    CallOff,
    DecideConfig,
    PendingJob,
    Reserve,
    RunningJob,
    Snapshot,
    Stop,
    Wait,
    decide,
)
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.snapshot import ElasticPolicy

NOW = 10_000.0
GROW = ElasticPolicy(grow_interval_s=60.0, min_step=1, min_fraction=0.25, grace_period_s=30.0)


def cluster(free: dict[str, int], total: int = 8) -> ClusterCapacity:
    """Nodes n0.. with `total` GPUs each, `free[node]` of them free (the first ones)."""
    return ClusterCapacity([NodeCapacity(n, total, set(range(f))) for n, f in free.items()])


def elastic(job: str = "e", lo: int = 2, hi: int = 4, gpus: int = 8, priority: int = 0) -> GangRequest:
    return GangRequest(job, hi, gpus, priority, 1.0, min_replicas=lo)


def running(request: GangRequest, nodes: list[str], cap: ClusterCapacity, started: float = 0.0, **kw) -> RunningJob:
    reps = tuple(ReplicaPlacement(i, n, tuple(range(request.gpus_per_replica))) for i, n in enumerate(nodes))
    placement = Placement(request.job_id, reps, "", 0, 0.0, "")
    for n in nodes:  # held by it
        cap.take(n, range(request.gpus_per_replica))
    return RunningJob(request, placement, started, progress_since=started, **kw)


def snap(cap: ClusterCapacity, pending=(), run=(), **config) -> Snapshot:
    return Snapshot(
        capacity=cap,
        pending=list(pending),
        running={r.job_id: r for r in run},
        config=DecideConfig(elastic=GROW, **config),
    )


# ---- placement -------------------------------------------------------------------------------------------------


def test_place_takes_the_maximum_when_it_fits():
    got = place_gang(cluster({f"n{i}": 8 for i in range(5)}), elastic(hi=4))
    assert isinstance(got, Placement) and len(got.replicas) == 4


def test_place_takes_as_many_as_fit_between_min_and_max():
    got = place_gang(cluster({"n0": 8, "n1": 8, "n2": 8, "n3": 0}), elastic(lo=2, hi=6))
    assert isinstance(got, Placement) and len(got.replicas) == 3
    assert [r.replica for r in got.replicas] == [0, 1, 2]
    assert "3 of at most 6" in got.reason


def test_place_refuses_below_the_minimum():
    got = place_gang(cluster({"n0": 8, "n1": 4}), elastic(lo=2, hi=4))
    assert isinstance(got, Unplaceable)
    assert "minimum of 2 of 4" in got.reason


# ---- starting ----------------------------------------------------------------------------------------------------


def test_starts_at_min_when_only_min_fit():
    cap = cluster({"n0": 8, "n1": 8, "n2": 0, "n3": 0})
    plan = decide(snap(cap, [PendingJob(elastic(lo=2, hi=4))]), NOW)
    (reserve,) = plan.of(Reserve)
    assert len(reserve.placement.replicas) == 2


def test_waits_whole_below_min():
    cap = cluster({"n0": 8, "n1": 0, "n2": 0})
    plan = decide(snap(cap, [PendingJob(elastic(lo=2, hi=4))]), NOW)
    assert not plan.of(Reserve)
    (wait,) = plan.of(Wait)
    assert "minimum of 2" in wait.status.reason


def test_a_higher_priority_gang_is_served_first():
    cap = cluster({"n0": 8, "n1": 8, "n2": 8})
    first = GangRequest("hi", 1, 8, 5, 2.0)
    plan = decide(snap(cap, [PendingJob(elastic(lo=2, hi=4)), PendingJob(first)]), NOW)
    sizes = {r.job: len(r.placement.replicas) for r in plan.of(Reserve)}
    assert sizes == {"hi": 1, "e": 2}


# ---- growing -----------------------------------------------------------------------------------------------------


def test_grows_through_the_checkpoint_handshake():
    cap = cluster({f"n{i}": 8 for i in range(4)})
    gang = running(elastic(lo=2, hi=4), ["n0", "n1"], cap)
    plan = decide(snap(cap, run=[gang]), NOW)
    (ask,) = plan.of(AskCheckpoint)
    assert ask.job == "e" and ask.by == "e" and ask.deadline == NOW + 30.0
    assert "from 2 to 4" in ask.request
    assert not plan.of(Stop)
    # Its checkpoint committed: stopped and placed again at the bigger size in the same decision, on its own nodes
    # among others.
    asked = replace(gang, preempted_by="e", deadline=NOW + 30.0, checkpoint_pending=False)
    plan = decide(snap(cap, run=[asked]), NOW + 5)
    (stop,) = plan.of(Stop)
    assert stop.resize and "grow from 2" in stop.reason
    (reserve,) = plan.of(Reserve)
    assert len(reserve.placement.replicas) == 4
    assert {"n0", "n1"} <= set(reserve.placement.nodes)


def test_no_grow_before_the_interval():
    cap = cluster({f"n{i}": 8 for i in range(4)})
    gang = running(elastic(lo=2, hi=4), ["n0", "n1"], cap, started=NOW - 10)
    plan = decide(snap(cap, run=[gang]), NOW)
    assert not plan.of(AskCheckpoint)
    assert plan.wake_at == NOW - 10 + 60.0


def test_no_grow_by_less_than_a_meaningful_step():
    cap = cluster({f"n{i}": 8 for i in range(9)} | {"n9": 0})
    gang = running(elastic(lo=4, hi=10), [f"n{i}" for i in range(8)], cap)  # 8 of 10: one more node free
    policy = ElasticPolicy(grow_interval_s=60.0, min_step=2, min_fraction=0.0, grace_period_s=30.0)
    snapshot = snap(cap, run=[gang])
    snapshot.config = DecideConfig(elastic=policy)
    assert not decide(snapshot, NOW).of(AskCheckpoint)


def test_no_grow_while_a_gang_of_equal_or_higher_priority_waits():
    cap = cluster({"n0": 8, "n1": 8, "n2": 8, "n3": 4})
    gang = running(elastic(lo=2, hi=4, priority=1), ["n0", "n1"], cap)
    blocked = GangRequest("big", 3, 8, 1, 5.0)  # does not fit: 1 node free
    plan = decide(snap(cap, [PendingJob(blocked)], run=[gang]), NOW)
    assert not plan.of(AskCheckpoint)
    lower = GangRequest("low", 3, 8, 0, 5.0)
    plan = decide(snap(cap, [PendingJob(lower)], run=[gang]), NOW)
    assert [a.job for a in plan.of(AskCheckpoint)] == ["e"]


def test_a_grow_whose_capacity_was_taken_is_called_off():
    cap = cluster({"n0": 8, "n1": 8, "n2": 0, "n3": 0})  # what it would have grown into is taken meanwhile
    gang = running(elastic(lo=2, hi=4), ["n0", "n1"], cap)
    asked = replace(gang, preempted_by="e", deadline=NOW + 30.0, checkpoint_pending=False)
    plan = decide(snap(cap, run=[asked]), NOW)
    assert not plan.of(Stop)
    (off,) = plan.of(CallOff)
    assert off.job == "e" and "called off" in off.reason


def test_grow_off_without_a_policy():
    cap = cluster({f"n{i}": 8 for i in range(4)})
    gang = running(elastic(lo=2, hi=4), ["n0", "n1"], cap)
    snapshot = snap(cap, run=[gang])
    snapshot.config = DecideConfig()
    assert not decide(snapshot, NOW).steps


# ---- shrinking ---------------------------------------------------------------------------------------------------


def test_requeued_after_a_loss_restarts_smaller_on_the_nodes_it_still_has():
    # It ran on n0-n3; n3 was lost (out of the index); n4 is free but another domain's: it prefers its own nodes.
    cap = cluster({"n0": 8, "n1": 8, "n2": 8, "n4": 8, "n5": 0})
    cap.set_schedulable("n4", False)  # say n4 is drained too: only its survivors remain
    request = replace(elastic(lo=2, hi=4), prefer=frozenset({"n0", "n1", "n2"}))
    (reserve,) = decide(snap(cap, [PendingJob(request)]), NOW).of(Reserve)
    assert sorted(reserve.placement.nodes) == ["n0", "n1", "n2"]


def test_never_below_min_after_a_loss():
    cap = cluster({"n0": 8, "n1": 2})
    plan = decide(snap(cap, [PendingJob(elastic(lo=2, hi=4))]), NOW)
    assert not plan.of(Reserve) and plan.of(Wait)


# ---- preemption --------------------------------------------------------------------------------------------------


def test_preemption_shrinks_an_elastic_victim_to_its_minimum_rather_than_evict_it():
    from phalanx.core.preemption import PreemptionPolicy

    cap = cluster({f"n{i}": 8 for i in range(4)})
    victim = running(elastic(lo=2, hi=4, priority=0), ["n0", "n1", "n2", "n3"], cap)
    urgent = GangRequest("urgent", 2, 8, 100, 5.0)
    snapshot = snap(cap, [PendingJob(urgent)], run=[victim])
    snapshot.config = DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.0))
    plan = decide(snapshot, NOW)
    (stop,) = plan.of(Stop)
    assert stop.job == "e" and stop.by == "urgent"
    placed = {r.job: r.placement for r in plan.of(Reserve)}
    assert len(placed["urgent"].nodes) == 2  # on what the victim gave up beyond its minimum
    assert len(placed["e"].replicas) == 2  # and the victim runs on at its minimum, in the same decision
    (ask,) = plan.of(AskCheckpoint)
    assert "restarts at its minimum of 2 replicas" in ask.message


def test_preemption_evicts_an_elastic_victim_whole_when_its_excess_is_not_enough():
    from phalanx.core.preemption import PreemptionPolicy

    cap = cluster({f"n{i}": 8 for i in range(4)})
    victim = running(elastic(lo=3, hi=4, priority=0), ["n0", "n1", "n2", "n3"], cap)
    urgent = GangRequest("urgent", 2, 8, 100, 5.0)
    snapshot = snap(cap, [PendingJob(urgent)], run=[victim])
    snapshot.config = DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.0))
    plan = decide(snapshot, NOW)
    placed = {r.job: r.placement for r in plan.of(Reserve)}
    assert len(placed["urgent"].nodes) == 2 and "e" not in placed  # evicted whole: 2 nodes left, below its 3
