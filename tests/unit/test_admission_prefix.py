"""The admission lane's reasoning (phalanx/core/admit.py, issue 35): on a settled view, arrivals strictly ahead of
the pending queue may be decided alone, and that decision reserves exactly what a full pass would give them, up to
the first that does not fit (the prefix property).

The property, on generated settled snapshots (a few nodes under leaf switches, some with NVLink domains, a second
GPU model, GPUs in MIG mode, failed GPUs; running gangs holding GPUs with and without time limits; GPUs of ended
gangs still being released; a pending queue of priority at most p, some in a retry backoff; quotas or none; no
claims, nobody preempting, nothing due) and arrivals of priority above p (whole, multi-replica, multi-level, MIG and
shared-GPU gangs; often a big one that blocks, then small ones):

- the lane (`decide(arrivals_snapshot(S, A))`) never preempts and reserves only arrivals;
- the full pass over the queue plus the arrivals (preemption off) reserves for the arrivals first exactly the lane's
  reservations (same gangs, placements and flavors, in the same order), and after them only backfills in front of
  the lane's blocked head (the same arrival in both);
- the arrivals the lane leaves to its quota are left to it by the full pass too.

Each decision plans on its own copy of the cluster: `decide` reserves in `snapshot.capacity` in place."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phalanx.core.admit import ahead_of_queue, arrivals_snapshot, unsettled
from phalanx.core.backfill import schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import (
    AskCheckpoint,
    CallOff,
    Code,
    DecideConfig,
    EndClaim,
    Memo,
    PendingJob,
    Plan,
    Reserve,
    RunningJob,
    SetClaim,
    Snapshot,
    Stop,
    Wait,
    decide,
)
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.preemption import PreemptionPolicy
from phalanx.core.quota import QueueSpec, demand
from phalanx.core.snapshot import ElasticPolicy
from phalanx.testing.world import ClusterSpec, JobSpec, Scenario, World
from tests.helpers.scenarios import jobs, lab_queues

pytestmark = pytest.mark.unit

NOW = 1_000.0
PENDING_PRIORITIES = (-100, 0, 100)
ARRIVAL_PRIORITIES = (0, 100, 200, 200, 300)

# Small clusters: the property is about order and placement, and contention comes cheaper on a few nodes.
clusters = st.builds(
    ClusterSpec,
    nodes=st.sampled_from((2, 3, 4, 6, 8)),
    gpus=st.sampled_from((8, 4)),
    per_leaf=st.sampled_from((2, 4)),
    nvlink=st.sampled_from((0, 0, 2)),
    mixed=st.booleans(),
    mig_gpus=st.sampled_from((0, 1, 2)),
)


@dataclass(frozen=True)
class Case:
    """A settled view and the arrivals drawn for it (of any priority: `ahead_of_queue` picks the lane's)."""

    cluster: ClusterSpec
    queues: tuple[QueueSpec, ...]
    running: tuple[tuple[JobSpec, float, bool], ...]  # (spec, started at, ended: its GPUs still being released)
    unusable: tuple[tuple[int, int], ...]  # (node index, GPU): a failed GPU, out of placement
    pending: tuple[PendingJob, ...]
    drawn: tuple[PendingJob, ...]
    config: DecideConfig  # the scheduler's (preemption and elastic grows may be on: the lane turns them off)


def pending_of(spec: JobSpec, submitted: float, not_before: float = 0.0) -> PendingJob:
    return PendingJob(spec.request(submitted), spec.queue, not_before, spec.by_admin, spec.preempts)


@st.composite
def small(draw, name: str, cluster: ClusterSpec, queues: tuple[str, ...]) -> JobSpec:
    """A gang of a few GPUs, often with a time limit: what fills the gaps a blocked head leaves (backfill)."""
    return JobSpec(
        name,
        replicas=draw(st.integers(1, 2)),
        gpus_per_replica=min(cluster.gpus, draw(st.sampled_from((1, 2, 4)))),
        queue=draw(st.sampled_from(queues)) if queues else "default",
        time_limit=draw(st.sampled_from((10.0, 20.0, 0.0))),
    )


def gangs(name: str, cluster: ClusterSpec, queues: tuple[str, ...]) -> st.SearchStrategy[JobSpec]:
    """The invariant checker's jobs (whole, multi-replica, multi-level, MIG, shared, a GPU model, a tier), or a
    small one."""
    return st.one_of(jobs(name, cluster, queues), small(name, cluster, queues))


@st.composite
def cases(draw) -> Case:
    cluster = draw(clusters)
    queues: tuple[QueueSpec, ...] = ()
    if draw(st.booleans()):
        queues = lab_queues(draw, cluster, ("a", "b"), mig=True)
    names = tuple(q.name for q in queues)
    running = tuple(
        (
            draw(gangs(f"r{i}", cluster, names)),
            NOW - draw(st.sampled_from((1.0, 5.0, 15.0))),
            draw(st.sampled_from((False, False, False, True))),
        )
        for i in range(draw(st.integers(0, 8)))
    )
    unusable = tuple(
        (draw(st.integers(0, cluster.nodes - 1)), draw(st.integers(0, cluster.gpus - 1)))
        for _ in range(draw(st.sampled_from((0, 0, 1, 2))))
    )
    pending = []
    for i in range(draw(st.integers(0, 4))):
        spec = dataclasses.replace(
            draw(gangs(f"p{i}", cluster, names)), priority=draw(st.sampled_from(PENDING_PRIORITIES))
        )
        not_before = draw(st.sampled_from((0.0, 0.0, 0.0, NOW + 30.0)))  # a retry backoff not over yet: not due
        pending.append(pending_of(spec, float(i + 1), not_before))
    drawn = []
    if draw(st.booleans()):
        # A big gang first (whole nodes without a GPU in MIG mode or unusable: it fits once the running gangs end),
        # most likely blocked by the running ones; then small gangs that may backfill in front of it.
        whole = cluster.nodes - len({i for i, _ in unusable} | ({cluster.nodes - 1} if cluster.mig_gpus else set()))
        size = draw(st.sampled_from((max(1, whole), max(1, min(whole, cluster.nodes // 2 + 1)))))
        big = JobSpec(
            "a-big", size, cluster.gpus, max(ARRIVAL_PRIORITIES), draw(st.sampled_from(names or ("default",)))
        )
        drawn.append(pending_of(dataclasses.replace(big, time_limit=draw(st.sampled_from((0.0, 30.0)))), NOW - 2.0))
        for i in range(draw(st.integers(1, 4))):
            spec = dataclasses.replace(draw(small(f"a{i}", cluster, names)), priority=200)
            drawn.append(pending_of(spec, NOW - 1.0 + i * 0.01))
    else:
        for i in range(draw(st.integers(1, 5))):
            priority = draw(st.sampled_from(ARRIVAL_PRIORITIES))
            spec = dataclasses.replace(draw(gangs(f"a{i}", cluster, names)), priority=priority)
            drawn.append(pending_of(spec, NOW - 1.0 + i * 0.01))
    grace = draw(st.sampled_from((0.0, 30.0)))
    config = DecideConfig(
        tiers=World(Scenario(cluster), check=False).tiers,
        preemption=draw(st.sampled_from((None, PreemptionPolicy(min_runtime_s=0.0, grace_period_s=grace)))),
        elastic=draw(st.sampled_from((None, ElasticPolicy()))),
        depth=draw(st.sampled_from((None, None, 1, 2))),
        poll_s=1.0,
        placement_budget_ms=0.0,  # no time budget: the same search, the same placement, in both decisions
    )
    return Case(cluster, queues, running, unusable, tuple(pending), tuple(drawn), config)


@dataclass
class Settled:
    """The view's parts both decisions share (each gets its own copy of `capacity`)."""

    capacity: ClusterCapacity
    running: dict[str, RunningJob]
    totals: dict[str, float]
    unusable: dict[str, set[int]]
    releasing: list[Placement]


def settled(case: Case) -> Settled:
    """The cluster with its unusable GPUs taken and the running gangs on it (those that fit, in order); the gangs
    that ended keep their whole GPUs until their nodes confirm the release (`releasing`, as the world holds them)."""
    world = World(Scenario(case.cluster, queues=case.queues), check=False)
    cap = world.capacity()
    names = sorted(cap.nodes)
    unusable: dict[str, set[int]] = {}
    for i, gpu in case.unusable:
        if gpu in cap.nodes[names[i]].free:
            cap.take(names[i], {gpu})
            unusable.setdefault(names[i], set()).add(gpu)
    running: dict[str, RunningJob] = {}
    releasing: list[Placement] = []
    for spec, started, ended in case.running:
        request = spec.request(started)
        placed = schedule_with_backfill(
            cap, [request], case.config.tiers, now=NOW, unusable=unusable, backfill=False
        ).placements
        if placed and ended and not request.partial:
            reps = tuple(ReplicaPlacement(k, r.node, r.gpus) for k, r in enumerate(placed[0].replicas))
            releasing.append(Placement(f"{request.job_id}/0", reps, "", 0, 0.0, "releasing"))
        elif placed:
            running[request.job_id] = RunningJob(
                request,
                placed[0],
                started,
                spec.queue,
                "*" if case.queues else "",
                progress_since=started,
                gpus=demand(request)[0] or 1.0,
            )
    return Settled(cap, running, world.totals(), unusable, releasing)


def snapshot(case: Case, view: Settled, pending: Sequence[PendingJob], config: DecideConfig) -> Snapshot:
    """The view on a copy of its capacity: `decide` plans on it in place."""
    return Snapshot(
        capacity=view.capacity.copy(),
        pending=list(pending),
        running=view.running,
        config=config,
        unusable=view.unusable,
        queues={q.name: q for q in case.queues},
        totals=view.totals,
        memo=Memo(),
        hold_on_stop=frozenset(view.capacity.nodes),
        releasing=view.releasing,
    )


def head_of(plan: Plan) -> Wait | None:
    """The pass's blocked head (with preemption off: the one Wait that is not a quota's)."""
    heads = [w for w in plan.of(Wait) if w.status.code != Code.QUOTA]
    assert len(heads) <= 1, heads
    return heads[0] if heads else None


def quota_waits(plan: Plan) -> set[str]:
    return {w.job for w in plan.of(Wait) if w.status.code == Code.QUOTA}


def reserves(steps: list[Reserve]) -> list[tuple[str, Placement, str]]:
    return [(r.job, r.placement, r.flavor) for r in steps]


def check_prefix(case: Case) -> list[str]:
    """The property on one case; returns what kind of case it was (for the statistics)."""
    others = [p.request.priority for p in case.pending]
    arrivals = ahead_of_queue(case.drawn, others)
    top = max(others, default=None)
    assert [a.job_id for a in arrivals] == [a.job_id for a in case.drawn if top is None or a.request.priority > top]
    ids = {a.job_id for a in arrivals}
    backoffs = [p.not_before for p in case.pending if p.not_before > NOW]
    wake_at = min(backoffs, default=math.inf)  # the only timers of a settled view: retry backoffs not over yet
    assert unsettled(pass_due=False, now=NOW, wake_at=wake_at, claims=0, preempting=0, timers_due=False) == ""

    view = settled(case)
    lane = decide(arrivals_snapshot(snapshot(case, view, case.pending, case.config), arrivals), NOW)
    full_config = dataclasses.replace(case.config, preemption=None)
    full = decide(snapshot(case, view, [*case.pending, *arrivals], full_config), NOW)

    # The lane: no preemption of any kind, and nothing reserved but arrivals.
    assert not [s for s in lane if isinstance(s, (AskCheckpoint, Stop, SetClaim, EndClaim, CallOff))], lane
    lane_reserves = lane.of(Reserve)
    assert {r.job for r in lane_reserves} <= ids
    assert all(not r.ahead_of for r in lane_reserves)  # backfill off: nothing is placed in front of a head

    # The full pass: its reservations for the arrivals begin with exactly the lane's.
    full_reserves = [r for r in full.of(Reserve) if r.job in ids]
    prefix, rest = full_reserves[: len(lane_reserves)], full_reserves[len(lane_reserves) :]
    assert reserves(prefix) == reserves(lane_reserves), (case, lane, full)
    assert all(not r.ahead_of for r in prefix)

    # The lane stops at the first arrival that does not fit; the full pass blocks on that same arrival, and places
    # arrivals after it only as backfills in front of it (ahead_of "" only when the head has no reservation: it does
    # not fit even once every running gang has ended).
    lane_head, full_head = head_of(lane), head_of(full)
    kinds = [f"lane reserves {min(len(lane_reserves), 2)}{'+' if len(lane_reserves) >= 2 else ''}"]
    if lane_head is None:
        assert not rest, (case, lane, full)
        assert full_head is None or full_head.job not in ids
    else:
        assert lane_head.job in ids and lane_head.job not in {r.job for r in full.of(Reserve)}
        assert full_head is not None and full_head.job == lane_head.job, (case, lane, full)
        behind = full_head.job if full_head.reservation is not None else ""
        assert all(r.ahead_of == behind for r in rest), (case, lane, full)
        kinds.append("an arrival blocked" + (", reserved for" if behind else ", never fits"))
        if rest:
            kinds.append("arrivals backfilled" + (" ahead of a reservation" if behind else " (no reservation)"))
    # What the lane's quotas refused, the full pass's refuse too (served in the same order, on the same charges).
    assert quota_waits(lane) <= quota_waits(full)
    if quota_waits(lane):
        kinds.append("an arrival refused by its quota")
    if case.queues:
        kinds.append("quotas")
    return kinds


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
def test_the_lane_reserves_the_full_passes_prefix_for_arrivals_ahead_of_the_queue(case: Case) -> None:
    for kind in check_prefix(case):
        event(kind)


# ---- examples ------------------------------------------------------------------------------------------------------


def whole(job: str, replicas: int, per: int, priority: int, submitted: float, limit: float = 0.0) -> PendingJob:
    return PendingJob(GangRequest(job, replicas, per, priority, submitted, time_limit=limit))


def gang(job: str, node: str, gpus: tuple[int, ...], limit: float = 0.0) -> RunningJob:
    request = GangRequest(job, 1, len(gpus), 0, 0.0, time_limit=limit)
    placement = Placement(job, (ReplicaPlacement(0, node, gpus),), "", 0, 0.0, "")
    return RunningJob(request, placement, 0.0, gpus=float(len(gpus)), progress_since=0.0)


def two_nodes() -> tuple[ClusterCapacity, dict[str, RunningJob]]:
    """node-01: 4 of 8 GPUs held until NOW + 100; node-02: all 8 held with no time limit. A pending 1x8 head (priority
    5) is blocked and reserves node-01 from NOW + 100."""
    cap = ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True) for n in ("node-01", "node-02"))
    running = {
        "short": gang("short", "node-01", (0, 1, 2, 3), limit=NOW + 100.0),
        "long": gang("long", "node-02", tuple(range(8))),
    }
    for r in running.values():
        cap.reserve(r.placement)
    return cap, running


def test_an_arrival_of_the_queues_top_priority_is_not_ahead_of_it() -> None:
    """Equal priority is not ahead: a pending job of that priority was there first, and a blocked head keeps its
    backfill reservation against the arrival. Alone, the arrival would take the GPUs the head is waiting for."""
    head = whole("head", 1, 8, 5, 1.0)
    same, higher = whole("same", 1, 4, 5, NOW), whole("higher", 1, 4, 6, NOW)
    assert ahead_of_queue([same], [5, 1]) == []
    assert ahead_of_queue([same, higher], [head.request.priority]) == [higher]
    assert ahead_of_queue([same, higher], [4]) == [same, higher]  # in the order given
    assert ahead_of_queue([same, higher], []) == [same, higher]  # an empty queue: every arrival is ahead

    def full_and_lane(arrival: PendingJob) -> tuple[list[str], float, list[str]]:
        """The full pass's reservations and its head's reserved start; the lane's reservations."""
        config = DecideConfig(poll_s=1.0, placement_budget_ms=0.0)
        cap, running = two_nodes()
        full = decide(Snapshot(capacity=cap, pending=[head, arrival], running=running, config=config), NOW)
        (wait,) = full.of(Wait)
        assert wait.job == "head" and wait.reservation is not None and wait.reservation.nodes == {"node-01"}
        cap, running = two_nodes()
        alone = arrivals_snapshot(Snapshot(capacity=cap, pending=[head], running=running, config=config), [arrival])
        return (
            [r.job for r in full.of(Reserve)],
            wait.reservation.start,
            [r.job for r in decide(alone, NOW).of(Reserve)],
        )

    # Behind the head (same priority, later), the 4-GPU gang without a time limit would delay it: the pass holds it
    # back, and the head keeps node-01 from NOW + 100. Alone, it would take the head's node. Hence not ahead.
    assert full_and_lane(same) == ([], NOW + 100.0, ["same"])
    # Strictly ahead, the pass serves it before the head, as the lane does (the head then waits for it to end).
    assert full_and_lane(higher) == (["higher"], math.inf, ["higher"])


SETTLED = dict(pass_due=False, now=NOW, wake_at=NOW + 1.0, claims=0, preempting=0, timers_due=False)


def test_unsettled_is_empty_only_when_nothing_is_due() -> None:
    assert unsettled(**SETTLED) == ""
    assert unsettled(**(SETTLED | {"wake_at": float("inf")})) == ""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"pass_due": True}, "a pass is due"),
        ({"wake_at": NOW}, "a wake-up is due"),  # due at the very moment
        ({"wake_at": NOW - 5.0}, "a wake-up is due"),
        ({"claims": 1}, "a claim is held"),
        ({"preempting": 2}, "a preemption is under way"),
        ({"timers_due": True}, "a timer is due"),
    ],
)
def test_unsettled_says_why_for_each_thing_due(change: dict, why: str) -> None:
    assert unsettled(**(SETTLED | change)) == why
