"""Job graphs in the cycle: dependencies that hold a job, and arrays whose tasks start a few at a time.

A job with unmet dependencies (`JobRecord.after`) stays PENDING and out of the decision (planning.pending_job gives
it no start time); so does an array's parent row (`JobRecord.array`), which only stands for its tasks. The leader's
pass (cycle.schedule) calls `advance` before it decides:

- each held job's dependencies on jobs that have ended (they left the view) are resolved from their final states:
  met ones are marked, and one that can never be met fails the job (PENDING -> FAILED, "dependency_failed: ...");
- each array's tasks that have ended are counted; while fewer than its limit run, the next indices become task rows
  (`array_parent`, `array_task`, name "NAME[i]", PHALANX_ARRAY_TASK_ID in their env), new jobs of this cycle that
  the same pass places; once the last one ended, the parent ends SUCCEEDED (all succeeded) or FAILED.

Both read the view, so it makes no difference which replica's cycle ended a job: a change another replica made
arrives through viewsync.apply_changes and the leader's next pass sees the job gone from the view.
"""

from __future__ import annotations

import math
import sys
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import structlog
from sqlalchemy import Connection, select

from db.models import Job, JobArchive
from phalanx.core import dependencies
from phalanx.core.arrays import parse_array, task_env, task_name

from . import lifecycle
from .convert import JOB_STATE_NAMES_ALL
from .state import JobRecord
from .transitions import Cycle, refused, set_job, teardown

log = structlog.get_logger()

# Tasks of one array created in one cycle, at most: the others become rows once these started, so a 10,000-task
# array is one row, plus one task waiting at the head of its queue while none can start.
PENDING_WINDOW = 64


def held(job: JobRecord) -> bool:
    """Whether the job stays out of the decision: an array's parent, or a job with a dependency not met yet."""
    return bool(job.array) or any(not d.get("met") for d in job.after)


def not_before(job: JobRecord) -> float:
    """The start time the decision sees: never, for a held job."""
    return math.inf if held(job) else job.not_before


def final_states(conn: Connection, ids: Iterable[str]) -> dict[str, str]:
    """The states of the jobs `ids` that the ledger has (finished ones moved to job_archive included)."""
    return {job_id: state for job_id, (state, _) in states_and_tenants(conn, ids).items()}


def states_and_tenants(conn: Connection, ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """(state, tenant) of the jobs `ids` that the ledger has, in `jobs` or moved to job_archive."""
    wanted = sorted(set(ids))
    out: dict[str, tuple[str, str]] = {}
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        for table in (Job, JobArchive):
            missing = [i for i in chunk if i not in out]
            if missing:
                rows = conn.execute(select(table.id, table.state, table.tenant).where(table.id.in_(missing)))
                out.update({r.id: (r.state, r.tenant or "") for r in rows})
    return out


def advance(cycle: Cycle) -> None:
    """Resolve the held jobs' dependencies and start, count and end arrays' tasks (see the module's doc)."""
    jobs = cycle.state.jobs
    graph = [j for j in jobs.in_state("PENDING").values() if j.after or j.array]
    if not graph:
        return
    wanted = {d["job_id"] for j in graph for d in j.after if not d.get("met") and d["job_id"] not in jobs}
    wanted |= {t for j in graph for t in (j.array.get("live") or {}) if t not in jobs}
    states = _ended_states(cycle, wanted) if wanted else {}
    _resolve_all(cycle, graph, states)
    ended = False
    for job in graph:
        if job.id in jobs and job.array and not held_by_dependencies(job):
            ended = _advance_array(cycle, job, states) or ended
    if ended:  # an array that ended here may be another job's dependency
        _resolve_all(cycle, graph, states)


def _resolve_all(cycle: Cycle, graph: list[JobRecord], states: dict[str, str]) -> None:
    progress = True
    while progress:  # a job failed here may be another's dependency: go round until nothing changes
        progress = False
        for job in graph:
            if job.id in cycle.state.jobs and job.after and _resolve(cycle, job, states):
                progress = True


def held_by_dependencies(job: JobRecord) -> bool:
    return any(not d.get("met") for d in job.after)


def _ended_states(cycle: Cycle, ids: set[str]) -> dict[str, str]:
    """Final states of jobs no longer in the view: those this cycle ended as it left them, the others as the ledger
    (committed before this cycle) has them."""
    out: dict[str, str] = {}
    for job_id in ids:
        changed = cycle.changed.get(job_id)
        if changed is not None:
            out[job_id] = JOB_STATE_NAMES_ALL.get(changed.state, "")
    rest = ids - set(out)
    if rest:
        out.update(cycle.work.read(final_states, rest))
    return out


def _resolve(cycle: Cycle, job: JobRecord, states: dict[str, str]) -> bool:
    """Apply the ended dependencies to `job`; True when it changed (some met, or it failed)."""
    after, reason = dependencies.resolve(job.after, states)
    if reason is None:
        gone = [d for d in after if not d.get("met") and d["job_id"] not in cycle.state.jobs]
        missing = next((d for d in gone if d["job_id"] not in states), None)
        if missing is not None:
            reason = f"dependency_failed: job {missing['job_id']} is no longer in the ledger"
    if reason is not None:
        fail(cycle, job, reason)
        states[job.id] = lifecycle.FAILED
        return True
    if after == job.after:
        return False
    message = dependencies.waiting_message(after) or ("queued" if not job.array else array_message(job.array))
    set_job(cycle, job, after=after, message=message)
    cycle.state.pass_due = True
    cycle.touched(job)
    log.info("dependencies_met" if not held_by_dependencies(job) else "dependency_met", job=job.id)
    return True


def fail(cycle: Cycle, job: JobRecord, reason: str) -> None:
    """A held job whose dependency can never be met: PENDING -> FAILED, with the reason."""
    if not lifecycle.allowed(job.state, "dependency_failed"):
        refused(job, "dependency_failed")
        return
    _finish(cycle, job, lifecycle.FAILED, reason)
    log.info("dependency_failed", job=job.id, reason=reason)


def _finish(cycle: Cycle, job: JobRecord, final: str, message: str, **changes: Any) -> None:
    set_job(cycle, job, state=final, finished_at=cycle.now, message=message, **changes)
    cycle.state.jobs.pop(job.id, None)
    cycle.finished.append(job.id)
    cycle.touched(job)


# ---- arrays -------------------------------------------------------------------------------------------------------


def new_array(text: str, max_size: int) -> dict[str, Any]:
    """An array parent's `array` JSON at submission: its spec, size and limit, nothing started."""
    spec = parse_array(text, max_size)
    return {
        "spec": spec.text,
        "tasks": spec.size,
        "limit": spec.limit,
        "next": 0,
        "live": {},
        "succeeded": 0,
        "failed": 0,
    }


def array_message(array: dict[str, Any]) -> str:
    """An array parent's message: its tasks' progress."""
    tasks, started = int(array.get("tasks", 0)), int(array.get("next", 0))
    live = len(array.get("live") or {})
    done = int(array.get("succeeded", 0)) + int(array.get("failed", 0))
    text = f"array of {tasks} tasks: {live} active, {done} done, {tasks - started} waiting"
    if array.get("failed"):
        text += f" ({array['failed']} failed)"
    return text


def _advance_array(cycle: Cycle, parent: JobRecord, states: dict[str, str]) -> bool:
    """Count its ended tasks, start the next ones; True when the array ended."""
    jobs = cycle.state.jobs
    array = dict(parent.array)
    live: dict[str, int] = dict(array.get("live") or {})
    changed = False
    for task_id in [t for t in live if t not in jobs]:
        key = "succeeded" if states.get(task_id) == lifecycle.SUCCEEDED else "failed"
        array[key] = int(array.get(key, 0)) + 1
        del live[task_id]
        changed = True
    tasks, started, limit = int(array["tasks"]), int(array["next"]), int(array.get("limit") or 0)
    if started >= tasks and not live:
        array["live"] = live
        outcome = lifecycle.SUCCEEDED if not array.get("failed") else lifecycle.FAILED
        if not lifecycle.allowed(parent.state, "array_done"):
            refused(parent, "array_done")
            return False
        _finish(cycle, parent, outcome, array_message(array), array=array)
        states[parent.id] = outcome
        log.info("array_done", job=parent.id, state=outcome, tasks=tasks, failed=array.get("failed", 0))
        return True
    room = _room(cycle, parent, live, limit, tasks - started)
    if room > 0:
        spec = parse_array(str(array["spec"]), sys.maxsize)
        for index in spec.indices[started : started + room]:
            task = new_task(parent, index, spec)
            cycle.state.jobs[task.id] = task
            cycle.work.new_jobs.append(task)
            live[task.id] = index
        array["next"] = started + room
        cycle.state.pass_due = True
        changed = True
    if changed:
        array["live"] = live
        set_job(cycle, parent, array=array, message=array_message(array))
        cycle.touched(parent)
    return False


def _room(cycle: Cycle, parent: JobRecord, live: dict[str, int], limit: int, left: int) -> int:
    """How many tasks to create now: none while one of its tasks still waits to be placed; else as many as the
    free GPUs could hold (at least one, which takes the array's place in the queue: it may hold a backfill
    reservation or preempt like any job), within its limit and PENDING_WINDOW."""
    jobs = cycle.state.jobs
    if any(jobs[t].state == lifecycle.PENDING for t in live):
        return 0
    gang = parent.replicas * parent.gpus_per_replica
    fit = cycle.state.capacity.free_gpus() // gang if gang and not (parent.mig_profile or parent.gpu_milli) else left
    room = min(max(1, fit), PENDING_WINDOW, left)
    return min(room, limit - len(live)) if limit else room


def new_task(parent: JobRecord, index: int, spec: Any) -> JobRecord:
    """Task `index` of the array `parent`: the parent's gang, its own id and row, the array's variables in its env."""
    task = replace(
        parent,
        id=uuid.uuid4().hex[:12],
        name=task_name(parent.name, index),
        command=list(parent.command),
        env={**parent.env, **task_env(parent.id, index, spec)},
        request_id=None,
        message="queued",
        placement={},
        version=-1,  # written by the cycle's closing writes (commands.write_new_jobs)
        allocations=[],
        ranks={},
        partials={},
        struck_nodes=[],
        serving=dict(parent.serving),
        after=[],
        array={},
        array_parent=parent.id,
        array_task=index,
        snapshot_cache={},
        table=None,
    )
    return task


def cancel_tasks(cycle: Cycle, parent: JobRecord) -> None:
    """CancelJob on an array's parent: its tasks that have started are cancelled with it, and no more start."""
    for task_id in list(parent.array.get("live") or {}):
        task = cycle.state.jobs.get(task_id)
        if task is None:
            continue
        if task.state == lifecycle.RUNNING:
            teardown(cycle, task, final_state=lifecycle.CANCELLED, message="cancelled with its array")
        elif lifecycle.allowed(task.state, "cancel"):
            _finish(cycle, task, lifecycle.CANCELLED, "cancelled with its array before it started")
