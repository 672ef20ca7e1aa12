"""The job state machine, table-driven, with no database and no server.

The real transitions (transitions.reserve and teardown, commands.submit_all, Cancel, RankReport, Drain,
cycle.fire_timers, planning.apply_plan) run on an in-memory view with a unit of work that has no connection
(`RecordingWork`): it records the writes and answers the reads from a table. Every state of lifecycle.STATES meets
every event of lifecycle.EVENTS; what lifecycle.TRANSITIONS allows must end in one of its states, and what it does
not allow must be refused, changing neither the job nor the ledger.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest

from phalanx.api.v1 import common_pb2
from phalanx.core.decide import Stop
from phalanx.core.model import Placement, ReplicaPlacement
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.scheduler import jobgraph, lifecycle
from services.scheduler.commands import Cancel, Drain, RankReport, RequestCheckpoint, Submit, submit_all
from services.scheduler.cycle import fire_timers
from services.scheduler.lifecycle import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED
from services.scheduler.planning import apply_plan
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import JobRecord, NodeRecord, SchedulerState
from services.scheduler.transitions import Cycle, reserve
from services.scheduler.work import UnitOfWork

T0 = 1_000.0
JOB = "job-1"
Row = namedtuple("Row", "state attempt")


class _NoConnection:
    """What the unit of work may look at without a database (ledger.pipelined asks the dialect's name)."""

    class dialect:
        name = "none"


class RecordingWork(UnitOfWork):
    """A unit of work without a connection: writes are recorded, reads answered from `answers` (name -> value, or
    a function of the read's arguments)."""

    DEFAULTS: dict[str, Any] = {
        "latest_commits": {},
        "service_endpoint": None,
        "set_node_state": True,  # the lease guard holds: nobody heard from the node since
        "strike_node": 1,
        "job_row": None,
        "append_assignments": [],
        "find_by_request_ids": {},
        "request_checkpoint": ("asked", T0),
    }

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        super().__init__(conn=_NoConnection())  # type: ignore[arg-type]
        self.answers = {**self.DEFAULTS, **(answers or {})}
        self.writes: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.asked: list[str] = []

    def write(self, statement: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.writes.append((statement.__name__, args, kwargs))

    def ask(self, statement: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        name = statement.__name__
        self.asked.append(name)
        if name not in self.answers:
            raise AssertionError(f"the life cycle asked the ledger {name}{args}: not expected here")
        answer = self.answers[name]
        return answer(*args, **kwargs) if callable(answer) else copy.deepcopy(answer)

    read = ask  # (a read that locks nothing: answered from the same table)

    def queued(self) -> list[str]:
        """The names of every write queued so far, applied or deferred."""
        return [w[0] for w in self.writes] + [s.__name__ for s, _ in self.deferred + self.claim_writes]

    def touches(self, job_id: str) -> bool:
        """Whether anything written or queued is about `job_id`."""

        def about(value: Any) -> bool:
            if isinstance(value, JobRecord):
                return value.id == job_id
            if isinstance(value, str):
                return value == job_id
            if isinstance(value, list | tuple):
                return any(about(v) for v in value)
            if isinstance(value, dict):
                return any(about(v) for v in value.values())
            return False

        return (
            any(about(args) or about(kwargs) for _, args, kwargs in self.writes)
            or any(about(args) for _, args in self.deferred + self.claim_writes)
            or any(item[1] == job_id for item in self.outbox)
            or any(r["job_id"] == job_id for r in self.rank_rows)
            or bool(self.new_jobs or self.new_allocations)
        )


# ---- a small cluster in memory -------------------------------------------------------------------------------------


def settings(**kw: Any) -> SchedulerSettings:
    return SchedulerSettings(db_url="sqlite://", checkpoint_addr="ckpt:1", **kw)


def new_state() -> SchedulerState:
    state = SchedulerState()
    state.nodes = {
        name: NodeRecord(
            id=i + 1,
            name=name,
            state="READY",
            gpus=2,
            gpu_ids={0: 2 * i + 1, 1: 2 * i + 2},
            gpu_model="H100",
            address=f"10.0.0.{i + 1}",
            last_heartbeat=T0,
        )
        for i, name in enumerate(("n0", "n1"))
    }
    state.rebuild_capacity()
    return state


def new_cycle(state: SchedulerState, now: float, answers: dict[str, Any] | None = None, **kw: Any):
    work = RecordingWork(answers)
    for node in state.nodes.values():  # the agents are alive unless a test says otherwise
        node.last_heartbeat = max(node.last_heartbeat, now)
    return Cycle(work, state, settings(**kw), now), work


def pending_job(**fields: Any) -> JobRecord:
    return JobRecord(
        id=JOB,
        name="train",
        state=PENDING,
        priority=0,
        replicas=2,
        gpus_per_replica=2,
        procs_per_replica=2,
        command=["python", "train.py"],
        env={},
        submitted_at=T0 - 10,
        request_id="req-1",
        version=1,
        **fields,
    )


PLACEMENT = Placement(JOB, (ReplicaPlacement(0, "n0", (0, 1)), ReplicaPlacement(1, "n1", (0, 1))), "leaf", 1, 0, "ok")


def start(state: SchedulerState, job: JobRecord, now: float = T0) -> JobRecord:
    """Reserve `job` in a cycle of its own, as the plan does (its GPUs taken in the capacity view)."""
    cycle, _ = new_cycle(state, now)
    reserve(cycle, job, PLACEMENT)
    for rep in PLACEMENT.replicas:
        state.capacity.take(rep.node, rep.gpus)
    return job


def world(job_state: str | None, **fields: Any) -> tuple[SchedulerState, JobRecord | None]:
    """A view with the job in `job_state`: None (never submitted), PENDING, RUNNING (reserved: its ranks ASSIGNED)
    or finished (gone from the view; the ledger's row is what RecordingWork answers for it)."""
    state = new_state()
    if job_state is None:
        return state, None
    job = pending_job(**fields)
    state.jobs[job.id] = job
    if job_state == PENDING:
        return state, job
    start(state, job)
    if job_state == RUNNING:
        return state, job
    del state.jobs[job.id]  # a finished job leaves the view
    job.state = job_state
    return state, job


def report(job: JobRecord, rank: int, state: str, exit_code: int = 0, attempt: int | None = None) -> RankReport:
    node = job.ranks[rank].node if job.ranks else "n0"
    return RankReport(node, job.id, job.attempt if attempt is None else attempt, rank, state, exit_code, "", 100 + rank)


# ---- the events, driven through the real entry points ---------------------------------------------------------------


def finished_row(job: JobRecord | None) -> dict[str, Any]:
    """What the ledger answers about a job the view does not hold."""
    return {"job_row": None if job is None else Row(job.state, job.attempt)}


def ev_submit(state, job, now):
    spec = common_pb2.JobSpec(name="train", replicas=2, gpus_per_replica=2, procs_per_replica=2, command=["x"])
    known = {} if job is None else {"req-1": job.id}
    cycle, work = new_cycle(state, now, {"find_by_request_ids": known})
    (result,) = submit_all(cycle, [Submit(spec, "req-1")]).values()
    return work, (result if job is None else job)


def ev_reserve(state, job, now):
    cycle, work = new_cycle(state, now)
    reserve(cycle, job, PLACEMENT)
    return work, job


def ev_retry(state, job, now):
    job.failures, job.not_before = 1, now - 1  # a failed attempt before, its backoff over
    if job.state == PENDING:
        job.attempt = 1
    before, was = job.attempt, job.state
    work, job = ev_reserve(state, job, now)
    if was == PENDING:
        assert (job.attempt, job.failures) == (before + 1, 1)  # a new attempt; the failure still counts
    return work, job


def ev_rank_running(state, job, now):
    cycle, work = new_cycle(state, now, finished_row(job))
    for rank in sorted(job.ranks) or [0]:
        report(job, rank, "RUNNING").execute(cycle)
    if job.state == RUNNING:
        assert job.running_at == now and job.launch_deadline is None
        assert [s.__name__ for s, _ in work.deferred] == ["mark_attempt_running"]
    return work, job


def ev_rank_exit(state, job, now):
    cycle, work = new_cycle(state, now, finished_row(job))
    for rank in sorted(job.ranks) or [0]:
        report(job, rank, "EXITED", 0).execute(cycle)
    return work, job


def ev_node_lost(state, job, now):
    state.nodes["n0"].last_heartbeat = now - 100  # silent past its lease
    cycle = Cycle(RecordingWork(), state, settings(), now)
    fire_timers(cycle)
    assert state.nodes["n0"].state == "LOST"
    return cycle.work, job


def ev_preempt(state, job, now):
    cycle, work = new_cycle(state, now)
    apply_plan(cycle, [Stop(job.id, "preempted by job-2", by="job-2")])
    return work, job


def ev_checkpoint_committed(state, job, now):
    """A victim asked to checkpoint (preempted_by set) whose checkpoint committed: the plan stops it (its next
    attempt restores the committed step: test_the_attempt_after_a_committed_checkpoint_restores_its_step)."""
    if job.state == RUNNING:
        job.preempted_by, job.preempt_deadline = "job-2", now + 60
    commit = {job.id: (40, job.attempt, now - 1)}
    cycle, work = new_cycle(state, now, {"latest_commits": commit})
    apply_plan(cycle, [Stop(job.id, "checkpoint committed at step 40", by="job-2")])
    return work, job


def ev_time_limit(state, job, now):
    job.time_limit = 60.0
    cycle, work = new_cycle(state, now + 61)
    fire_timers(cycle)
    return work, job


def ev_cancel(state, job, now):
    cycle, work = new_cycle(state, now, finished_row(job))
    Cancel(job.id).execute(cycle)
    return work, job


def ev_drain(state, job, now):
    cycle, work = new_cycle(state, now)
    assert Drain("n0", "agent stopping").execute(cycle)
    assert state.nodes["n0"].state == "DRAINED"
    return work, job


def ev_dependency_failed(state, job, now):
    """A job waiting for dep-1 to succeed; dep-1 ended FAILED (jobgraph.advance, the leader's pass)."""
    was = job.state
    job.after = [{"job_id": "dep-1", "condition": "ok", "met": False}]
    cycle, work = new_cycle(state, now, {"final_states": {"dep-1": "FAILED"}})
    jobgraph.advance(cycle)
    if was == PENDING:
        assert job.message.startswith("dependency_failed: job dep-1 ended FAILED") and job.id not in state.jobs
    return work, job


def ev_array_done(state, job, now):
    """An array's parent whose one task, its last, ended SUCCEEDED."""
    was = job.state
    job.array = {"spec": "0", "tasks": 1, "limit": 0, "next": 1, "live": {"task-1": 0}, "succeeded": 0, "failed": 0}
    cycle, work = new_cycle(state, now, {"final_states": {"task-1": "SUCCEEDED"}})
    jobgraph.advance(cycle)
    if was == PENDING:
        assert job.array["succeeded"] == 1 and job.id in cycle.finished
    return work, job


EVENTS: dict[str, Callable[..., tuple[RecordingWork, JobRecord]]] = {
    "submit": ev_submit,
    "reserve": ev_reserve,
    "rank_running": ev_rank_running,
    "rank_exit": ev_rank_exit,
    "node_lost": ev_node_lost,
    "preempt": ev_preempt,
    "checkpoint_committed": ev_checkpoint_committed,
    "time_limit": ev_time_limit,
    "cancel": ev_cancel,
    "retry": ev_retry,
    "drain": ev_drain,
    "dependency_failed": ev_dependency_failed,
    "array_done": ev_array_done,
}

# The node-wide events change the node's rows whatever the job's state: "changing nothing" means nothing of the job
NODE_EVENTS = {"node_lost", "drain"}


def test_every_event_of_the_table_has_a_driver():
    assert set(EVENTS) == set(lifecycle.EVENTS)
    assert {s for s, _ in lifecycle.TRANSITIONS} <= set(lifecycle.STATES)


# ---- the matrix: every state x every event ------------------------------------------------------------------------

MATRIX = [(s, e) for s in lifecycle.STATES if s is not None for e in lifecycle.EVENTS] + [(None, "submit")]


@pytest.mark.parametrize("job_state, event", MATRIX, ids=[f"{s}-{e}" for s, e in MATRIX])
def test_each_state_meets_each_event(job_state, event):
    state, job = world(job_state)
    before = None if job is None else copy.deepcopy(_fields(job))
    work, job = EVENTS[event](state, job, T0 + 5)
    allowed = lifecycle.successors(job_state, event)
    if allowed:
        assert job.state in allowed, f"{job_state} --{event}--> {job.state}, the table allows {sorted(allowed)}"
        return
    # Refused: the job's record and its rows are as they were
    assert _fields(job) == before
    assert not work.touches(job.id), work.queued()
    if event not in NODE_EVENTS:
        assert work.queued() == []
    assert (job.id in state.jobs) == (job_state in (PENDING, RUNNING))


def _fields(job: JobRecord) -> dict[str, Any]:
    out = {k: v for k, v in vars(job).items() if k not in ("table", "snapshot_cache")}
    out.pop("time_limit", None), out.pop("not_before", None), out.pop("failures", None)  # what the drivers set
    out.pop("preempted_by", None), out.pop("preempt_deadline", None)
    out.pop("after", None), out.pop("array", None)
    return out


# ---- the branches of the legal transitions --------------------------------------------------------------------------


def test_submit_queues_a_pending_job_written_after_the_plan_and_a_repeated_request_returns_it():
    state, _ = world(None)
    spec = common_pb2.JobSpec(name="t", replicas=1, gpus_per_replica=2, command=["x"])
    cycle, work = new_cycle(state, T0)
    first, second = submit_all(cycle, [Submit(spec, "r"), Submit(spec, "r")]).values()
    assert first is second and first.state == PENDING and first.version == -1
    assert work.new_jobs == [first] and work.queued() == []  # inserted by the closing writes (write_new_jobs)
    assert state.pass_due


def test_reserve_lays_out_the_ranks_queues_the_launches_and_arms_the_launch_deadline():
    state, job = world(PENDING)
    cycle, work = new_cycle(state, T0)
    reserve(cycle, job, PLACEMENT)
    assert (job.state, job.attempt, job.started_at) == (RUNNING, 1, T0)
    assert {r.state for r in job.ranks.values()} == {"ASSIGNED"} and len(job.ranks) == 4
    assert job.launch_deadline == T0 + cycle.settings.launch_timeout
    assert [(n.name, kind) for n, _, _, kind, _ in work.outbox] == [("n0", "launch"), ("n1", "launch")]
    assert work.new_allocations == [job] and [w[0] for w in work.writes] == ["queue_job_update"]
    assert cycle.woken_nodes == {"n0", "n1"} and JOB in cycle.changed


@pytest.mark.parametrize(
    "exit_codes, max_restarts, expected, cause",
    [
        ((0, 0, 0, 0), 0, SUCCEEDED, "SUCCEEDED"),
        ((0, 0), 0, RUNNING, None),  # two ranks still running
        ((1,), 0, FAILED, "FAILED"),
        ((1,), 2, PENDING, "RANK_FAILED"),  # within max_restarts: requeued, counted, backoff
    ],
)
def test_rank_exits(exit_codes, max_restarts, expected, cause):
    state, job = world(RUNNING, max_restarts=max_restarts)
    cycle, work = new_cycle(state, T0 + 5)
    for rank, code in enumerate(exit_codes):
        report(job, rank, "EXITED", code).execute(cycle)
    assert job.state == expected
    ends = [args for s, args in work.deferred if s.__name__ == "end_attempt"]
    assert [a[1] for a in ends] == ([cause] if cause else [])
    if expected == PENDING:
        assert job.failures == 1 and job.not_before == T0 + 5 + cycle.settings.retry_backoff_s
    if expected in lifecycle.FINAL:
        assert JOB not in state.jobs and cycle.finished == [JOB]


@pytest.mark.parametrize("failures_before, expected", [(0, PENDING), (4, FAILED)])
def test_a_lost_node_requeues_its_gangs_with_a_backoff_until_max_attempts(failures_before, expected):
    state, job = world(RUNNING)
    job.failures = failures_before
    state.nodes["n1"].last_heartbeat = T0 - 100
    cycle = Cycle(RecordingWork(), state, settings(max_attempts=5), T0)
    fire_timers(cycle)
    assert job.state == expected and job.failures == failures_before + 1
    assert state.nodes["n1"].state == "LOST"
    kills = [(n.name, kind) for n, _, _, kind, _ in cycle.work.outbox]
    assert ("n0", "kill") in kills  # the gang's ranks on the surviving node are killed
    names = cycle.work.queued()
    assert "set_node_state" in cycle.work.asked and "set_node_state" not in names  # a guarded write: its answer counts
    assert "add_node_events" in names and "queue_job_update" in names


def test_a_node_heard_from_by_another_replica_is_not_lost():
    state, job = world(RUNNING)
    state.nodes["n1"].last_heartbeat = T0 - 100
    cycle = Cycle(RecordingWork({"set_node_state": False}), state, settings(), T0)
    fire_timers(cycle)
    assert job.state == RUNNING and state.nodes["n1"].state == "READY" and cycle.resync_after


def test_a_preempted_gang_is_requeued_at_once_without_counting_a_failure():
    state, job = world(RUNNING)
    cycle, work = new_cycle(state, T0 + 5)
    apply_plan(cycle, [Stop(JOB, "make way", by="job-2")])
    assert (job.state, job.failures, job.preemptions, job.not_before) == (PENDING, 0, 1, 0.0)
    assert cycle.metrics.preempted == [(JOB, "job-2")] and cycle.handover
    assert {s.__name__ for s, _ in work.deferred} == {"mark_attempt_preempted", "end_attempt", "release_allocations"}


def test_a_time_limit_fails_the_job_and_a_launch_deadline_requeues_it():
    state, job = world(RUNNING, time_limit=30.0)
    cycle, _ = new_cycle(state, T0 + 30)
    fire_timers(cycle)
    assert job.state == FAILED and "time limit" in job.message
    state, job = world(RUNNING)
    cycle, _ = new_cycle(state, T0 + settings().launch_timeout + 1)
    fire_timers(cycle)
    assert job.state == PENDING and job.failures == 1 and "did not start" in job.message


@pytest.mark.parametrize("job_state", [PENDING, RUNNING])
def test_cancel(job_state):
    state, job = world(job_state)
    cycle, work = new_cycle(state, T0 + 5)
    Cancel(JOB).execute(cycle)
    assert job.state == CANCELLED and JOB not in state.jobs and cycle.finished == [JOB]
    kills = [kind for _, _, _, kind, _ in work.outbox]
    assert kills == ([] if job_state == PENDING else ["kill", "kill"])


def test_a_drained_node_keeps_its_gang_until_the_agent_reports_the_ranks_killed():
    state, job = world(RUNNING)
    cycle, _ = new_cycle(state, T0 + 5)
    assert Drain("n0", "stopping").execute(cycle)
    assert job.state == RUNNING and not state.nodes["n0"].schedulable
    report(job, 0, "KILLED").execute(cycle)
    assert job.state == PENDING and job.failures == 1 and "killed" in job.message
    assert not Drain("n0", "again").execute(cycle)  # a drained node drains no more


# ---- refusals of the commands ---------------------------------------------------------------------------------------


def test_rank_reports_the_running_attempt_cannot_take_are_refused_changing_nothing():
    state, job = world(RUNNING)
    cycle, work = new_cycle(state, T0 + 5, {"job_row": Row(RUNNING, 1)})
    report(job, 0, "RUNNING").execute(cycle)
    before, rows = copy.deepcopy(_fields(job)), len(work.rank_rows)
    assert report(job, 0, "RUNNING").execute(cycle) is False  # a repeat
    assert report(job, 1, "RUNNING", attempt=0).execute(cycle) is True  # an old attempt: the agent must kill it
    with pytest.raises(InvalidArgument, match="has no rank"):  # rank 0 is on n0
        RankReport("n1", JOB, 1, 0, "RUNNING", 0, "", 1).execute(cycle)
    with pytest.raises(NotFound):
        RankReport("n9", JOB, 1, 0, "RUNNING", 0, "", 1).execute(cycle)
    assert _fields(job) == before and len(work.rank_rows) == rows and job.state == RUNNING
    report(job, 0, "EXITED", 0).execute(cycle)
    rows = len(work.rank_rows)
    assert report(job, 0, "RUNNING").execute(cycle) is False  # a rank that ended does not run again
    assert len(work.rank_rows) == rows and job.ranks[0].state == "EXITED"


def test_commands_about_a_job_never_submitted_are_refused():
    state, _ = world(None)
    cycle, work = new_cycle(state, T0, {"job_row": None})
    with pytest.raises(NotFound):
        Cancel("nope").execute(cycle)
    with pytest.raises(NotFound):
        RequestCheckpoint("nope", "manual").execute(cycle)
    assert RankReport("n0", "nope", 1, 0, "RUNNING", 0, "", 1).execute(cycle) is True  # the agent must kill it
    assert work.queued() == [] and not state.jobs


def test_a_checkpoint_is_asked_of_a_running_job_only():
    state, job = world(PENDING)
    cycle, work = new_cycle(state, T0)
    with pytest.raises(FailedPrecondition, match="only a running job"):
        RequestCheckpoint(JOB, "manual").execute(cycle)
    assert work.queued() == []
    start(state, job)
    cycle, work = new_cycle(state, T0 + 1)
    RequestCheckpoint(JOB, "manual").execute(cycle)
    assert "request_checkpoint" in work.asked and job.state == RUNNING


def test_the_attempt_after_a_committed_checkpoint_restores_its_step():
    state, job = world(RUNNING)
    job.preempted_by, job.preempt_deadline = "job-2", T0 + 60
    commit = {JOB: (40, 1, T0 + 1)}
    cycle, _ = new_cycle(state, T0 + 5, {"latest_commits": commit})
    apply_plan(cycle, [Stop(JOB, "checkpoint committed at step 40", by="job-2")])
    assert (job.state, job.preempted_by, job.preemptions, job.failures) == (PENDING, "", 1, 0)
    for rep in PLACEMENT.replicas:  # what the decision gave back (released=True)
        state.capacity.release(rep.node, set(rep.gpus))
    again, work = new_cycle(state, T0 + 6, {"latest_commits": commit})
    reserve(again, job, PLACEMENT)
    assert (job.state, job.attempt, job.restored_step) == (RUNNING, 2, 40)
    assert "latest_commits" in work.asked
