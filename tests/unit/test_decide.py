"""The one pure decision (phalanx/core/decide.py), as scenario tables: the cluster, the queue, the expected plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import (
    AskCheckpoint,
    CallOff,
    Code,
    DecideConfig,
    Memo,
    PendingJob,
    Plan,
    Reserve,
    RunningJob,
    Snapshot,
    Status,
    Stop,
    Wait,
    WakeAt,
    clock,
    decide,
)
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.preemption import PreemptionPolicy
from phalanx.core.quota import FlavorQuota, QueueSpec

NOW = 10_000.0
PREEMPT = PreemptionPolicy(min_runtime_s=600.0, grace_period_s=120.0)


# ---- builders ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A running gang: `where` is {node: GPU indices}, one replica per node."""

    job: str
    where: dict[str, tuple[int, ...]]
    priority: int = 0
    started: float = 0.0
    limit: float = 0.0
    queue: str = "default"
    preempted_by: str = ""
    deadline: float = 0.0
    checkpoint_pending: bool = True
    flavor: str = "*"  # the quota flavor it was admitted under

    def build(self) -> RunningJob:
        reps = tuple(ReplicaPlacement(i, n, g) for i, (n, g) in enumerate(self.where.items()))
        per = len(next(iter(self.where.values())))
        request = GangRequest(self.job, len(reps), per, self.priority, self.started, time_limit=self.limit)
        return RunningJob(
            request,
            Placement(self.job, reps, "", 0, 0.0, ""),
            self.started,
            self.queue,
            self.flavor,
            gpus=float(len(reps) * per),
            progress_since=self.started,
            preempted_by=self.preempted_by,
            deadline=self.deadline,
            checkpoint_pending=self.checkpoint_pending,
        )


@dataclass(frozen=True)
class Ask:
    """A pending gang."""

    job: str
    replicas: int
    gpus: int
    priority: int = 0
    submitted: float = 1.0
    limit: float = 0.0
    queue: str = "default"
    not_before: float = 0.0

    def build(self) -> PendingJob:
        return PendingJob(
            GangRequest(self.job, self.replicas, self.gpus, self.priority, self.submitted, time_limit=self.limit),
            self.queue,
            self.not_before,
        )


@dataclass(frozen=True)
class Case:
    name: str
    nodes: dict[str, int]  # node -> GPUs (one leaf, no fabric)
    running: list[Run]
    queue: list[Ask]
    want: list[tuple]  # the plan, each step as ("reserve", job, nodes) / ("ask", job, by) / ("stop", job, by) /
    # ("wait", job, code, text in reason) / ("wake", t) / ("calloff", job)
    config: DecideConfig = DecideConfig(preemption=PREEMPT, poll_s=5.0)
    queues: dict[str, QueueSpec] = field(default_factory=dict)


def snapshot_of(case: Case) -> Snapshot:
    cap = ClusterCapacity(NodeCapacity(n, g, set(range(g)), True) for n, g in case.nodes.items())
    running = {r.job: r.build() for r in case.running}
    for r in running.values():
        cap.reserve(r.placement)
    totals = {"gpus": float(sum(case.nodes.values()))}
    return Snapshot(
        capacity=cap,
        pending=[a.build() for a in case.queue],
        running=running,
        config=case.config,
        queues=case.queues,
        totals=totals,
        memo=Memo(),
    )


def summary(plan: Plan) -> list[tuple]:
    out = []
    for s in plan:
        if isinstance(s, Reserve):
            out.append(("reserve", s.job, tuple(sorted(s.placement.nodes))))
        elif isinstance(s, AskCheckpoint):
            out.append(("ask", s.job, s.by))
        elif isinstance(s, Stop):
            out.append(("stop", s.job, s.by))
        elif isinstance(s, CallOff):
            out.append(("calloff", s.job))
        elif isinstance(s, Wait):
            out.append(("wait", s.job, s.status.code, s.status.reason))
        elif isinstance(s, WakeAt):
            out.append(("wake", s.t))
    return out


def matches(got: list[tuple], want: list[tuple]) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g[0] != w[0]:
            return False
        if w[0] == "wait":
            if g[1:3] != w[1:3] or w[3] not in g[3]:
                return False
        elif g != w:
            return False
    return True


QUOTAS = {
    "a": QueueSpec("a", {"*": FlavorQuota(gpus=8, borrow_limit=0)}),
    "b": QueueSpec("b", {"*": FlavorQuota(gpus=8)}),
}
COHORT = {
    "own": QueueSpec("own", {"*": FlavorQuota(gpus=8)}, cohort="c"),
    "lend": QueueSpec("lend", {"*": FlavorQuota(gpus=0)}, cohort="c"),
}

CASES = [
    Case(
        "a gang that fits is reserved whole",
        nodes={"n1": 8, "n2": 8},
        running=[],
        queue=[Ask("g", 2, 8)],
        want=[("reserve", "g", ("n1", "n2"))],
    ),
    Case(
        "a gang that does not fit waits holding nothing, with a typed reason",
        nodes={"n1": 8, "n2": 8},
        running=[Run("r", {"n1": tuple(range(8))}, started=NOW - 60)],
        queue=[Ask("g", 2, 8)],
        want=[("wait", "g", Code.UNSCHEDULABLE, "waiting, holding no GPUs")],
    ),
    Case(
        "a higher-priority gang asks a lower one to checkpoint, and waits for it",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, priority=0, started=NOW - 3600)],
        queue=[Ask("hi", 1, 8, priority=10)],
        want=[
            ("ask", "lo", "hi"),
            ("wait", "hi", Code.PREEMPTING, "preempting 1 lower-priority gang(s) (lo)"),
            ("wake", NOW + 5.0),
        ],
    ),
    Case(
        "a victim whose checkpoint is committed is stopped, and the preemptor takes its GPUs in the same plan",
        nodes={"n1": 8},
        running=[
            Run(
                "lo",
                {"n1": tuple(range(8))},
                started=NOW - 3600,
                preempted_by="hi",
                deadline=NOW + 60,
                checkpoint_pending=False,
            )
        ],
        queue=[Ask("hi", 1, 8, priority=10)],
        want=[
            ("stop", "lo", "hi"),
            ("reserve", "hi", ("n1",)),
            ("wait", "lo", Code.UNSCHEDULABLE, "waiting, holding no GPUs"),
        ],
    ),  # requeued, it waits its turn
    Case(
        "a victim past its grace period is stopped even without a checkpoint",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, started=NOW - 3600, preempted_by="hi", deadline=NOW)],
        queue=[Ask("hi", 1, 8, priority=10)],
        want=[
            ("stop", "lo", "hi"),
            ("reserve", "hi", ("n1",)),
            ("wait", "lo", Code.UNSCHEDULABLE, "waiting, holding no GPUs"),
        ],
    ),  # requeued, it waits its turn
    Case(
        "a victim still checkpointing keeps its GPUs; look again at the poll interval",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, started=NOW - 3600, preempted_by="hi", deadline=NOW + 60)],
        queue=[Ask("hi", 1, 8, priority=10)],
        want=[("wait", "hi", Code.PREEMPTING, "waiting for 1 preempted gang(s) (lo)"), ("wake", NOW + 5.0)],
    ),
    Case(
        "a victim whose preemptor no longer waits is called off",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, started=NOW - 3600, preempted_by="gone", deadline=NOW + 60)],
        queue=[],
        want=[("calloff", "lo")],
    ),
    Case(
        "with a zero grace period the victims stop at once and the preemptor is placed in the same plan",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, started=NOW - 3600)],
        queue=[Ask("hi", 1, 8, priority=10)],
        config=DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0, grace_period_s=0), poll_s=5.0),
        want=[
            ("ask", "lo", "hi"),
            ("stop", "lo", "hi"),
            ("wait", "hi", Code.PREEMPTING, "preempting"),
            ("reserve", "hi", ("n1",)),
            ("wait", "lo", Code.UNSCHEDULABLE, "waiting, holding no GPUs"),
        ],
    ),
    Case(
        "equal priorities never preempt",
        nodes={"n1": 8},
        running=[Run("r", {"n1": tuple(range(8))}, started=NOW - 3600)],
        queue=[Ask("g", 1, 8)],
        want=[("wait", "g", Code.UNSCHEDULABLE, "waiting, holding no GPUs")],
    ),
    Case(
        "a gang protected by its minimum runtime: wait, and wake when the protection ends",
        nodes={"n1": 8},
        running=[Run("lo", {"n1": tuple(range(8))}, started=NOW - 100)],
        queue=[Ask("hi", 1, 8, priority=10)],
        want=[("wait", "hi", Code.PROTECTED, "minimum runtime of 600s"), ("wake", NOW + 500)],
    ),
    Case(
        "a short gang is backfilled in front of the blocked head's reservation",
        nodes={"n1": 8, "n2": 8},
        running=[Run("r", {"n1": tuple(range(8))}, started=NOW - 60, limit=1000)],
        queue=[
            Ask("head", 2, 8, submitted=1),
            Ask("short", 1, 8, submitted=2, limit=100),
            Ask("long", 1, 8, submitted=3, limit=5000),
        ],
        config=DecideConfig(),
        want=[("reserve", "short", ("n2",)), ("wait", "head", Code.UNSCHEDULABLE, "next in line and starts by")],
    ),
    Case(
        "without backfill the queue stops at the head",
        nodes={"n1": 8, "n2": 8},
        running=[Run("r", {"n1": tuple(range(8))}, started=NOW - 60, limit=1000)],
        queue=[Ask("head", 2, 8, submitted=1), Ask("short", 1, 8, submitted=2, limit=100)],
        config=DecideConfig(backfill=False),
        want=[("wait", "head", Code.UNSCHEDULABLE, "waiting, holding no GPUs")],
    ),
    Case(
        "a quota refuses a gang; another queue's gang goes on",
        nodes={"n1": 8, "n2": 8},
        running=[Run("a1", {"n1": tuple(range(8))}, started=NOW - 60, queue="a")],
        queue=[Ask("a2", 1, 8, queue="a", submitted=1), Ask("b1", 1, 8, queue="b", submitted=2)],
        queues=QUOTAS,
        config=DecideConfig(),
        want=[("wait", "a2", Code.QUOTA, "waiting for quota, holding no GPUs"), ("reserve", "b1", ("n2",))],
    ),
    Case(
        "a head within its nominal quota reclaims what another queue of its cohort borrowed",
        nodes={"n1": 8},
        running=[Run("borrower", {"n1": tuple(range(8))}, priority=50, started=NOW - 3600, queue="lend")],
        queue=[Ask("owner", 1, 8, queue="own")],
        queues=COHORT,
        want=[("ask", "borrower", "owner"), ("wait", "owner", Code.PREEMPTING, "preempting"), ("wake", NOW + 5.0)],
    ),
    Case(
        "a job in its retry backoff neither runs nor holds the queue; wake when the backoff ends",
        nodes={"n1": 8},
        running=[],
        queue=[Ask("backoff", 1, 8, submitted=0, not_before=NOW + 30), Ask("next", 1, 8, submitted=1)],
        want=[("reserve", "next", ("n1",)), ("wake", NOW + 30)],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decide(case: Case) -> None:
    plan = decide(snapshot_of(case), NOW)
    got = summary(plan)
    assert matches(got, case.want), f"\n got: {got}\nwant: {case.want}"


def test_the_index_holds_the_cluster_as_the_plan_leaves_it():
    case = CASES[3]  # stop "lo", reserve "hi" on its GPUs
    snap = snapshot_of(case)
    decide(snap, NOW)
    assert snap.capacity.free_gpus() == 0
    case = CASES[1]  # nothing fits: nothing is held
    snap = snapshot_of(case)
    before = snap.capacity.free_gpus()
    decide(snap, NOW)
    assert snap.capacity.free_gpus() == before


def test_a_reclaim_is_marked_and_a_priority_preemption_is_not():
    plan = decide(snapshot_of(CASES[13]), NOW)
    assert [s.reclaim for s in plan.of(AskCheckpoint)] == [True]
    plan = decide(snapshot_of(CASES[2]), NOW)
    ask = plan.of(AskCheckpoint)[0]
    assert not ask.reclaim and ask.deadline == NOW + PREEMPT.grace_period_s


def test_the_extension_point_can_hold_the_head_instead_of_preempting():
    seen = []

    def hold(head, result, pending, backfill):
        seen.append((head, tuple(pending), backfill))
        return "waiting for GPU 0 of n1 to switch to MIG mode", ""

    plan = decide(snapshot_of(CASES[2]), NOW, after_blocked=hold)
    assert summary(plan) == [("wait", "hi", Code.EXTENSION, "waiting for GPU 0 of n1 to switch to MIG mode")]
    assert seen == [("hi", ("hi",), True)]


def test_a_blocked_head_does_not_pay_for_the_search_twice():
    case = CASES[9]  # protected: no victims until the protection ends
    snap = snapshot_of(case)
    first = decide(snap, NOW)
    again = decide(
        Snapshot(
            capacity=snap.capacity, pending=snap.pending, running=snap.running, config=snap.config, memo=snap.memo
        ),
        NOW + 1,
    )
    assert summary(first)[0] == summary(again)[0] and again.wake_at == first.wake_at


def test_plans_are_data():
    plan = decide(snapshot_of(CASES[0]), NOW)
    assert isinstance(plan.steps, tuple) and plan.wake_at == math.inf
    with pytest.raises(AttributeError):
        plan.steps[0].job = "other"  # frozen
    assert Status(Code.QUOTA, "x") == Status(Code.QUOTA, "x")


def _held_snapshot(case: Case, releasing=()) -> Snapshot:
    snap = snapshot_of(case)
    for p in releasing:  # GPUs of ended gangs still held on their nodes (their processes are exiting)
        snap.capacity.reserve(p)
    return Snapshot(
        capacity=snap.capacity,
        pending=snap.pending,
        running=snap.running,
        config=snap.config,
        memo=snap.memo,
        hold_on_stop=frozenset(case.nodes),
        releasing=tuple(releasing),
    )


def test_a_stop_on_a_node_that_holds_gpus_until_release_hands_nothing_over_and_preempts_no_more():
    """Clean handover: the victim is stopped, but its GPUs stay held until its node's agent says its processes are
    gone; the preemptor waits for them, and no other gang is preempted meanwhile."""
    case = Case(
        "held on stop",
        {"n1": 8, "n2": 8},
        [
            Run("lo1", {"n1": tuple(range(8))}, priority=0, preempted_by="hi", deadline=NOW - 1),
            Run("lo2", {"n2": tuple(range(8))}, priority=0),
        ],
        [Ask("hi", 1, 8, priority=10)],
        [],
        config=DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=120.0), poll_s=5.0),
    )
    plan = summary(decide(_held_snapshot(case), NOW))
    assert ("stop", "lo1", "hi") in plan
    assert not [s for s in plan if s[0] in ("reserve", "ask")]  # nothing placed on held GPUs, lo2 left alone
    (wait,) = [s for s in plan if s[0] == "wait"]
    assert wait[1] == "hi" and wait[2] == Code.PREEMPTING and "releasing" in wait[3] and "lo1" in wait[3]

    # Later: still releasing (the snapshot lists it), the head keeps waiting without a new victim ...
    held = Placement("lo1/1", (ReplicaPlacement(0, "n1", tuple(range(8))),), "", 0, 0.0, "releasing")
    later = Case("still releasing", case.nodes, [case.running[1]], case.queue, [], config=case.config)
    plan = summary(decide(_held_snapshot(later, [held]), NOW + 1))
    assert not [s for s in plan if s[0] in ("reserve", "ask")] and "releasing" in plan[0][3]
    # ... and once released, it is placed on them.
    plan = summary(decide(_held_snapshot(later), NOW + 2))
    assert ("reserve", "hi", ("n1",)) in plan


def test_without_held_nodes_a_stop_hands_its_gpus_over_in_the_same_decision():
    case = Case(
        "handover",
        {"n1": 8},
        [Run("lo1", {"n1": tuple(range(8))}, priority=0, preempted_by="hi", deadline=NOW - 1)],
        [Ask("hi", 1, 8, priority=10)],
        [],
        config=DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=120.0), poll_s=5.0),
    )
    plan = summary(decide(snapshot_of(case), NOW))
    assert ("stop", "lo1", "hi") in plan and ("reserve", "hi", ("n1",)) in plan


def test_a_users_job_preempts_another_queues_gang_only_when_an_admin_submitted_it():
    """Priority decides within a queue; across queues a job preempts only to take back borrowed quota, unless an
    admin submitted it (issue 20, item 5)."""
    policy = DecideConfig(preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.0), poll_s=5.0)
    for by_admin, same_queue, preempts in (
        (False, False, False),
        (True, False, True),
        (False, True, True),
    ):
        case = Case(
            "cross-queue",
            {"n1": 8},
            [Run("lo", {"n1": tuple(range(8))}, priority=0, queue="a")],
            [],
            [],
            config=policy,
        )
        snap = snapshot_of(case)
        head = PendingJob(GangRequest("hi", 1, 8, 100, 1.0), "a" if same_queue else "b", 0.0, by_admin)
        snap = Snapshot(
            capacity=snap.capacity, pending=[head], running=snap.running, config=policy, memo=Memo(), totals=snap.totals
        )
        plan = summary(decide(snap, NOW))
        assert (("stop", "lo", "hi") in plan) is preempts, (by_admin, same_queue, plan)


def test_a_blocked_heads_reason_names_the_job_and_the_time_it_waits_for():
    case = Case(
        "reason",
        {"n1": 8, "n2": 8},
        [Run("r", {"n1": tuple(range(8))}, started=NOW - 10, limit=100.0)],
        [Ask("head", 2, 8, submitted=1.0)],
        [],
        config=DecideConfig(preemption=None, poll_s=math.inf),
    )
    (wait,) = [s for s in summary(decide(snapshot_of(case), NOW)) if s[0] == "wait"]
    assert f"starts by {clock(NOW + 90)} at the latest, when job r's time limit ends" in wait[3], wait[3]
    assert "kept from gangs" not in wait[3]
