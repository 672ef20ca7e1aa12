"""Checkpoint requests and the ranks' step agreement: a request asks the job's ranks to checkpoint; while it is
outstanding every rank reports the step it completed, and once all did the target step is max(reported) + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import (
    CheckpointRequest,
    CheckpointStepReport,
    Job,
)
from phalanx.core import checkpoint_policy as cp
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

from ._records import _possible_job_id
from .jobs import _fence, _require_job, ledger_world_size
from .policy import _poll_policy


@dataclass(frozen=True)
class RequestRecord:
    requested: bool
    reason: str = ""
    requested_at: float = 0.0
    policy: cp.CheckpointPolicy | None = None
    target_step: int | None = None  # the agreed step of the polling attempt, once decided
    ranks_reported: int = 0  # ranks of the polling attempt that reported a step for this request
    decided: bool = False  # this report completed the agreement (for the log)
    restarted: bool = False  # this report was past the target: the agreement started over (for the log)


def request_checkpoint(engine: Engine, job_id: str, reason: str, *, now: float | None = None) -> RequestRecord:
    """Ask the job's ranks to checkpoint; an earlier outstanding request is kept (its time and reason)."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    if "\x00" in reason or len(reason) > 1000:
        raise InvalidArgument("reason must be at most 1000 characters, without NUL")
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        _require_job(conn, job_id)
        # Ranks whose time policy fires ask at about the same moment: the first insert wins, the rest keep it.
        dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(
            dialect_insert(CheckpointRequest)
            .values(job_id=job_id, reason=reason, requested_at=ts)
            .on_conflict_do_nothing(index_elements=["job_id"])
        )
        row = _request_row(conn, job_id)
        return RequestRecord(True, row.reason, row.requested_at)


def _request_row(conn, job_id: str):
    return conn.execute(select(CheckpointRequest).where(CheckpointRequest.job_id == job_id)).first()


def _target(row, attempt: int) -> int | None:
    """The request's agreed step for `attempt` (None: undecided, or decided by another attempt)."""
    if row.target_step is None or row.target_attempt != attempt:
        return None
    return int(row.target_step)


def _reports(conn, job_id: str, attempt: int, requested_at: float, world: int) -> tuple[int, int | None]:
    """(ranks 0..world-1 of `attempt` that reported a step for the request of `requested_at`, their highest step)."""
    count, top = conn.execute(
        select(func.count(), func.max(CheckpointStepReport.step)).where(
            CheckpointStepReport.job_id == job_id,
            CheckpointStepReport.attempt == attempt,
            CheckpointStepReport.requested_at == requested_at,
            CheckpointStepReport.rank < world,
        )
    ).one()
    return int(count or 0), None if top is None else int(top)


MAX_REPORTED_STEP = (1 << 63) - 1


def _check_report_rank(job_id: str, attempt: int, rank: int, world: int) -> None:
    if world > 0 and not 0 <= rank < world:
        raise InvalidArgument(f"rank must be in 0..{world - 1} for job {job_id[:80]!r} attempt {attempt}, got {rank}")


def get_request(
    engine: Engine, job_id: str, attempt: int, rank: int = 0, step: int | None = None, *, now: float | None = None
) -> RequestRecord:
    """The outstanding request for the job's current attempt (a superseded attempt is refused), with the job's
    checkpoint interval policy and, once decided, the step every rank of the attempt checkpoints at.

    `step` (the step `rank` has just completed; None: a read-only poll) takes part in the step agreement: while a
    request is outstanding and undecided, the rank's report is recorded (`_report_step`). A poll with no request
    outstanding, or a step at or before a decided target, only reads (the common case: one read-only
    transaction)."""
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    if step is not None:
        if not 0 <= step < MAX_REPORTED_STEP:  # the target, step + 1, must fit a BIGINT
            raise InvalidArgument(f"step must be in 0..{MAX_REPORTED_STEP - 1}, got {step}")
        if rank < 0:
            raise InvalidArgument(f"rank must be >= 0, got {rank}")
    with engine.execution_options(readonly=True).begin() as conn:
        if not _possible_job_id(job_id):
            raise NotFound(f"job {job_id[:80]!r} not found")
        job = conn.execute(
            select(Job.attempt, Job.replicas, Job.gpus_per_replica, Job.procs_per_replica).where(Job.id == job_id)
        ).first()
        if job is None:
            raise NotFound(f"job {job_id[:80]!r} not found")
        current = job.attempt
        if attempt != current:
            raise FailedPrecondition(
                f"job {job_id[:80]!r} attempt {attempt} is superseded: the current attempt is {current}"
            )
        row = _request_row(conn, job_id)
        policy = _poll_policy(conn, job_id, current)
        if row is None:  # most polls: nothing requested, nothing more to read
            return RequestRecord(False, policy=policy)
        target = _target(row, attempt)
        if step is None or (target is not None and step <= target):
            world = ledger_world_size(conn, job_id, attempt, job.replicas, job.gpus_per_replica, job.procs_per_replica)
            if step is None:
                reported, _ = _reports(conn, job_id, attempt, row.requested_at, world)
            else:
                _check_report_rank(job_id, attempt, rank, world)
                reported = world  # decided: every rank has reported
            return RequestRecord(True, row.reason, row.requested_at, policy, target, reported)
    return _report_step(engine, job_id, attempt, rank, step, policy, time.time() if now is None else now)


def _report_step(
    engine: Engine, job_id: str, attempt: int, rank: int, step: int, policy: cp.CheckpointPolicy, now: float
) -> RequestRecord:
    """Record `rank`'s step for the outstanding request and decide the target once every rank reported.

    Fenced like every write (the job row locked, the current attempt, RUNNING), so the ranks' reports are
    serialised and exactly one of them sees every rank reported and decides. A step past the decided target comes
    from a rank that cannot checkpoint at it (it did not learn it in time): the agreement of this attempt starts
    over from this report, and the new target is necessarily later."""
    with engine.begin() as conn:
        world = _fence(conn, job_id, attempt)
        _check_report_rank(job_id, attempt, rank, world)
        row = _request_row(conn, job_id)
        if row is None:  # a commit cleared it since the read
            return RequestRecord(False, policy=policy)
        requested_at = row.requested_at
        target = _target(row, attempt)
        if target is not None and step <= target:  # decided since the read: stable
            reported, _ = _reports(conn, job_id, attempt, requested_at, world)
            return RequestRecord(True, row.reason, requested_at, policy, target, reported)
        this_request = (CheckpointRequest.job_id == job_id, CheckpointRequest.requested_at == requested_at)
        restarted = target is not None
        if restarted:
            conn.execute(
                delete(CheckpointStepReport).where(
                    CheckpointStepReport.job_id == job_id,
                    CheckpointStepReport.attempt == attempt,
                    CheckpointStepReport.requested_at == requested_at,
                )
            )
        if row.target_step is not None:  # past it, or another attempt's: undecided for this attempt
            conn.execute(update(CheckpointRequest).where(*this_request).values(target_attempt=None, target_step=None))
        values = dict(step=step, requested_at=requested_at, reported_at=now)
        dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(
            dialect_insert(CheckpointStepReport)
            .values(job_id=job_id, attempt=attempt, rank=rank, **values)
            .on_conflict_do_update(index_elements=["job_id", "attempt", "rank"], set_=values)
        )
        reported, top = _reports(conn, job_id, attempt, requested_at, world)
        decided = None
        if reported >= world and top is not None:
            decided = top + 1
            conn.execute(
                update(CheckpointRequest).where(*this_request).values(target_attempt=attempt, target_step=decided)
            )
        return RequestRecord(True, row.reason, requested_at, policy, decided, reported, decided is not None, restarted)
