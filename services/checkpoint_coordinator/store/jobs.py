"""The job row as the coordinator reads it: who owns the job, its current attempt, the fence every write takes
(lock the row, refuse another attempt or an ended one), and the attempt's world size from the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, func, select

from db.models import (
    Allocation,
    Job,
)
from services.common.errors import FailedPrecondition, NotFound

from ._records import MAX_JOB_ID, MAX_WORLD_SIZE, _possible_job_id


def _require_job(conn, job_id: str) -> None:
    if not _possible_job_id(job_id) or conn.scalar(select(Job.id).where(Job.id == job_id)) is None:
        raise NotFound(f"job {job_id[:80]!r} not found")


def _current_attempt(conn, job_id: str) -> int:
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    current = conn.scalar(select(Job.attempt).where(Job.id == job_id))
    if current is None:
        raise NotFound(f"job {job_id[:80]!r} not found")
    return int(current)


@dataclass(frozen=True)
class JobOwner:
    tenant: str
    attempt: int
    state: str


def job_owner(engine: Engine, job_id: str) -> JobOwner | None:
    """Whose the job is and which attempt runs (for authorization); None when there is no such job."""
    if not job_id or len(job_id) > MAX_JOB_ID:
        return None
    with engine.connect() as conn:
        row = conn.execute(select(Job.tenant, Job.attempt, Job.state).where(Job.id == job_id)).first()
    return None if row is None else JobOwner(row.tenant or "", int(row.attempt), row.state)


def ledger_world_size(
    conn, job_id: str, attempt: int, replicas: int, gpus_per_replica: int, procs_per_replica: int
) -> int:
    """The number of ranks of the job's `attempt`, from what the ledger records for it: its allocations (the
    scheduler's layout, services/scheduler/state.py layout_ranks: one rank per GPU of each replica, or one per
    replica when procs_per_replica is 1; a MIG instance or a share is one GPU), else, before any allocation of the
    attempt is recorded, the job's replicas x ranks per replica."""
    per_replica = conn.execute(
        select(Allocation.replica, func.count(func.distinct(Allocation.gpu_index)))
        # A negative replica is a spare kept in the domain (services/scheduler/spares.py): held, with no rank
        .where(Allocation.job_id == job_id, Allocation.attempt == attempt, Allocation.kind != "hold")
        .where(Allocation.replica >= 0)
        .group_by(Allocation.replica)
    ).all()
    if per_replica:
        if procs_per_replica == 1:
            return len(per_replica)
        return sum(int(n) for _, n in per_replica)
    return max(0, replicas) * (1 if procs_per_replica == 1 else max(0, gpus_per_replica))


def _fence(conn, job_id: str, attempt: int) -> int:
    """Lock the job row (PostgreSQL: FOR UPDATE; SQLite: BEGIN IMMEDIATE already holds the write lock) and refuse
    any attempt but the job's current one, and the current one once the scheduler tore it down (the job is no
    longer RUNNING: requeued, or finished). The teardown writes that row in the transaction that closes the
    attempt, so a commit lands before it (and counts for it) or is refused.

    Returns the attempt's world size from the ledger (`ledger_world_size`)."""
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    row = conn.execute(
        select(Job.attempt, Job.state, Job.replicas, Job.gpus_per_replica, Job.procs_per_replica)
        .where(Job.id == job_id)
        .with_for_update()
    ).first()
    if row is None:
        raise NotFound(f"job {job_id[:80]!r} not found")
    if attempt != row.attempt:
        raise FailedPrecondition(
            f"job {job_id[:80]!r} attempt {attempt} is superseded: the current attempt is {row.attempt}; "
            "a checkpoint of another attempt is refused"
        )
    if row.state != "RUNNING":
        raise FailedPrecondition(
            f"job {job_id[:80]!r} attempt {attempt} has ended (the job is {row.state}); its ranks are being stopped "
            "and a checkpoint of it is refused"
        )
    world = ledger_world_size(conn, job_id, attempt, row.replicas, row.gpus_per_replica, row.procs_per_replica)
    if not 0 < world <= MAX_WORLD_SIZE:
        raise FailedPrecondition(f"job {job_id[:80]!r} attempt {attempt} has no ranks in the ledger ({world})")
    return world
