"""The leader's job-graph step (services/scheduler/jobgraph.advance) on an in-memory view, with no database: which
array tasks it creates (the free GPUs, the '%' limit, one task holding the array's place on a full cluster, none
while one waits), how it counts their ends and ends the array, and that a held job is out of the decision."""

from __future__ import annotations

import math
from typing import Any

from services.scheduler import jobgraph
from services.scheduler.planning import pending_job
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import JobRecord, NodeRecord, SchedulerState
from services.scheduler.transitions import Cycle
from services.scheduler.work import UnitOfWork

T0 = 1_000.0


class _NoConnection:
    class dialect:
        name = "none"


class Work(UnitOfWork):
    """Writes recorded; the one read the step makes (final_states) answered from `ended`."""

    def __init__(self, ended: dict[str, str] | None = None) -> None:
        super().__init__(conn=_NoConnection())  # type: ignore[arg-type]
        self.ended = ended or {}
        self.writes: list[tuple[str, tuple[Any, ...]]] = []

    def write(self, statement, *args, **kwargs) -> None:
        self.writes.append((statement.__name__, args))

    def ask(self, statement, *args, **kwargs):
        assert statement.__name__ == "final_states", statement
        return {i: self.ended[i] for i in args[0] if i in self.ended}

    read = ask


def view(nodes: int = 2) -> SchedulerState:
    state = SchedulerState()
    state.nodes = {
        f"n{i}": NodeRecord(id=i + 1, name=f"n{i}", state="READY", gpus=8, gpu_ids={g: 8 * i + g for g in range(8)})
        for i in range(nodes)
    }
    state.rebuild_capacity()
    return state


def job(job_id: str, **fields: Any) -> JobRecord:
    return JobRecord(
        id=job_id,
        name=job_id,
        state="PENDING",
        priority=0,
        replicas=1,
        gpus_per_replica=8,
        procs_per_replica=1,
        command=["x"],
        env={"A": "1"},
        submitted_at=T0 - 10,
        version=1,
        **fields,
    )


def cycle_on(state: SchedulerState, ended: dict[str, str] | None = None) -> Cycle:
    return Cycle(Work(ended), state, SchedulerSettings(db_url="sqlite://"), T0)


def array_job(text: str, **progress: Any) -> JobRecord:
    return job("arr", array={**jobgraph.new_array(text, 10_001), **progress})


def tasks_of(state: SchedulerState, parent: str = "arr") -> list[JobRecord]:
    return [j for j in state.jobs.values() if j.array_parent == parent]


def test_an_array_creates_as_many_tasks_as_the_free_gpus_hold_within_its_limit():
    state = view(nodes=4)
    state.jobs["arr"] = array_job("0-19%3")
    cycle = cycle_on(state)
    jobgraph.advance(cycle)
    tasks = tasks_of(state)
    assert [t.array_task for t in tasks] == [0, 1, 2] and len(cycle.work.new_jobs) == 3
    assert [t.name for t in tasks] == ["arr[0]", "arr[1]", "arr[2]"]
    assert tasks[0].env["PHALANX_ARRAY_TASK_ID"] == "0" and tasks[0].env["A"] == "1"
    assert tasks[0].version == -1 and not tasks[0].array and tasks[0].request_id is None
    parent = state.jobs["arr"]
    assert parent.array["next"] == 3 and set(parent.array["live"]) == {t.id for t in tasks}
    assert parent.message == "array of 20 tasks: 3 active, 0 done, 17 waiting"
    # While one of them waits to be placed, no more are made
    jobgraph.advance(cycle_on(state))
    assert len(tasks_of(state)) == 3


def test_on_a_full_cluster_one_task_holds_the_arrays_place():
    state = view(nodes=1)
    state.capacity.take("n0", range(8))
    state.jobs["arr"] = array_job("0-9999")
    jobgraph.advance(cycle_on(state))
    assert len(tasks_of(state)) == 1 and state.jobs["arr"].array["next"] == 1


def test_ended_tasks_are_counted_and_the_last_ends_the_array():
    state = view()
    state.jobs["arr"] = array_job("0-1", next=2, live={"t0": 0, "t1": 1})
    cycle = cycle_on(state, {"t0": "SUCCEEDED", "t1": "FAILED"})
    jobgraph.advance(cycle)
    assert "arr" not in state.jobs and cycle.finished == ["arr"]
    assert (cycle.changed["arr"].array.succeeded, cycle.changed["arr"].array.failed) == (1, 1)
    assert cycle.changed["arr"].message == "array of 2 tasks: 0 active, 2 done, 0 waiting (1 failed)"


def test_a_job_after_an_array_that_ends_in_the_same_pass_is_released_in_it():
    state = view()
    state.jobs["arr"] = array_job("0", next=1, live={"t0": 0})
    state.jobs["next"] = job("next", after=[{"job_id": "arr", "condition": "ok", "met": False}])
    jobgraph.advance(cycle_on(state, {"t0": "SUCCEEDED"}))
    assert state.jobs["next"].after[0]["met"] and state.jobs["next"].message == "queued"
    assert not jobgraph.held(state.jobs["next"])


def test_a_failed_dependency_fails_its_chain_in_one_pass():
    state = view()
    state.jobs["b"] = job("b", after=[{"job_id": "a", "condition": "ok", "met": False}])
    state.jobs["c"] = job("c", after=[{"job_id": "b", "condition": "ok", "met": False}])
    state.jobs["d"] = job("d", after=[{"job_id": "c", "condition": "notok", "met": False}])
    cycle = cycle_on(state, {"a": "CANCELLED"})
    jobgraph.advance(cycle)
    assert sorted(cycle.finished) == ["b", "c"]
    assert cycle.changed["b"].message.startswith("dependency_failed: job a ended CANCELLED")
    assert state.jobs["d"].after[0]["met"]  # c FAILED: what d waited for


def test_a_held_job_is_never_started_by_the_decision():
    waiting = job("w", after=[{"job_id": "a", "condition": "ok", "met": False}])
    assert pending_job(waiting).not_before == math.inf
    assert pending_job(array_job("0-3")).not_before == math.inf
    waiting.after[0]["met"] = True
    assert pending_job(waiting).not_before == 0.0
