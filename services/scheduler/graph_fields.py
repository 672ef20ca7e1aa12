"""What a job may ask for as part of a job graph (JobSpec.after, JobSpec.array): every problem in words, before
anything is written. `graph_problems` checks the spec alone (servicer.validate_spec raises them as
INVALID_ARGUMENT); `SubmitGraph` checks the dependencies against the ledger inside the submitting cycle (unknown
jobs, cycles, dependencies that can never be met) and fills in the new job's `after` and `array`.

Dependencies on a job that has already ended are settled at submission: one its end met counts as met (the job
may start at once); one its end can never meet (afterok on a FAILED job, afternotok on a SUCCEEDED one) is refused
with INVALID_ARGUMENT, like Slurm's "Job dependency problem", rather than accepted only to fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phalanx.api.v1 import common_pb2
from phalanx.core import dependencies
from phalanx.core.arrays import DEFAULT_MAX_ARRAY_SIZE, ArrayError, parse_array
from services.common.errors import InvalidArgument

from .jobgraph import new_array, states_and_tenants
from .state import JobRecord
from .transitions import Cycle

MAX_JOB_ID = 32  # jobs.id
__all__ = ["DEFAULT_MAX_ARRAY_SIZE", "SubmitGraph", "after_of_spec", "graph_problems"]


def graph_problems(spec: common_pb2.JobSpec, max_array_size: int) -> list[str]:
    """What is wrong with a JobSpec's dependencies and array on their own."""
    problems: list[str] = []
    if len(spec.after) > dependencies.MAX_DEPENDENCIES:
        problems.append(f"a job may wait for at most {dependencies.MAX_DEPENDENCIES} jobs, got {len(spec.after)}")
    for dep in spec.after:
        if not dep.job_id.strip() or len(dep.job_id) > MAX_JOB_ID or not dep.job_id.isprintable():
            problems.append(f"dependency job id {dep.job_id[:40]!r} is not a job id")
            break
        try:
            dependencies.normalize(dep.condition)
        except ValueError as exc:
            problems.append(f"dependency on job {dep.job_id}: {exc}")
            break
    if spec.array:
        try:
            parse_array(spec.array, max_array_size)
        except ArrayError as exc:
            problems.append(str(exc))
    return problems


def after_of_spec(spec: common_pb2.JobSpec) -> list[dict[str, Any]]:
    """The spec's dependencies as jobs.after keeps them, each (job, condition) once."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for dep in spec.after:
        condition = dependencies.normalize(dep.condition)
        out.setdefault((dep.job_id, condition), {"job_id": dep.job_id, "condition": condition, "met": False})
    return list(out.values())


class SubmitGraph:
    """The dependency checks of one cycle's submissions, with one ledger read for the jobs they name that the view
    does not hold (those that ended, or never existed)."""

    def __init__(self, cycle: Cycle, specs: Sequence[common_pb2.JobSpec]) -> None:
        self.cycle = cycle
        jobs = cycle.state.jobs
        named = {d.job_id for spec in specs for d in spec.after if d.job_id not in jobs}
        self.ended: dict[str, tuple[str, str]] = cycle.work.read(states_and_tenants, named) if named else {}

    def check(self, spec: common_pb2.JobSpec, tenant: str, admin: bool, job_id: str = "") -> list[dict[str, Any]]:
        """The dependencies of a job submitted with `spec` (`job_id`: the job a repeated request id names), met
        ones marked; InvalidArgument for an unknown job, one that can never be met, or a cycle."""
        after = after_of_spec(spec)
        jobs = self.cycle.state.jobs
        states: dict[str, str] = {}
        for dep in after:
            other = jobs.get(dep["job_id"])
            if dep["job_id"] == job_id:
                raise InvalidArgument(f"job {job_id} cannot wait for itself")
            state, owner = (other.state, other.tenant) if other is not None else self.ended.get(dep["job_id"], ("", ""))
            if not state or (owner != tenant and tenant and not admin):  # another tenant's job is not known to a user
                raise InvalidArgument(f"unknown dependency: no job with id {dep['job_id']!r}")
            if other is None:
                states[dep["job_id"]] = state
        after, reason = dependencies.resolve(after, states)
        if reason is not None:
            raise InvalidArgument(f"dependency can never be met: {reason.removeprefix('dependency_failed: ')}")
        if job_id:
            path = dependencies.find_cycle(
                [d["job_id"] for d in after if not d["met"]], job_id, lambda j: _waits_for(jobs.get(j))
            )
            if path is not None:
                raise InvalidArgument(f"dependency cycle: job {job_id} would wait for {' -> '.join(path)}")
        return after

    def apply(self, job: JobRecord, spec: common_pb2.JobSpec, after: list[dict[str, Any]]) -> None:
        """The new job's graph fields: what it waits for, its array, and its first message."""
        job.after = after
        if spec.array:
            job.array = new_array(spec.array, 1 << 62)  # its size was checked by graph_problems
        message = dependencies.waiting_message(after)
        if message:
            job.message = message
        elif job.array:
            job.message = f"array of {job.array['tasks']} tasks: waiting to start"


def _waits_for(job: JobRecord | None) -> list[str]:
    if job is None:
        return []
    waits = [d["job_id"] for d in job.after if not d.get("met")]
    if job.array_parent:  # a task waits for whatever its array waits for
        waits.append(job.array_parent)
    return waits
