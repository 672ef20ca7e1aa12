"""Attempt, rank and checkpoint-request rows: an attempt's start, running and end, ranks' reports, requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, bindparam, case, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import Checkpoint, CheckpointRequest, JobAttempt, Rank, ServiceEndpoint

from ..state import JobRecord
from ._sql import _changed_jobs, _chunks, insert_rows

RANK_VALUES = ("state", "exit_code", "pid", "message", "updated_at")


def record_ranks(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """`record_rank` for many reports in one statement; each row has the Rank columns. The last row of a rank
    wins (one statement may not update a row twice)."""
    last = {(r["job_id"], r["attempt"], r["rank"]): r for r in rows}
    if not last:
        return
    _changed_jobs(conn, *{k[0] for k in last}, sched=False)
    stmt = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(Rank)
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "attempt", "rank"], set_={c: stmt.excluded[c] for c in RANK_VALUES}
    )
    conn.execute(stmt, list(last.values()))


def latest_commits(conn: Connection, job_ids: Sequence[str]) -> dict[str, tuple[int, int, float]]:
    """Each job's latest committed checkpoint (highest step) as (step, attempt, created_at: when the step was
    reached), for the jobs that have one."""
    if not job_ids:
        return {}
    out: dict[str, tuple[int, int, float]] = {}
    for chunk in _chunks(list(job_ids), 500):
        ranked = (
            select(
                Checkpoint.job_id,
                Checkpoint.step,
                Checkpoint.attempt,
                Checkpoint.created_at,
                func.row_number()
                .over(partition_by=Checkpoint.job_id, order_by=(Checkpoint.step.desc(), Checkpoint.committed_at.desc()))
                .label("n"),
            )
            .where(Checkpoint.job_id.in_(chunk), Checkpoint.state == "COMMITTED")
            .subquery()
        )
        for row in conn.execute(select(ranked).where(ranked.c.n == 1)):
            out[row.job_id] = (int(row.step), int(row.attempt), float(row.created_at))
    return out


def insert_attempts(conn: Connection, jobs: Sequence[JobRecord], now: float) -> None:
    """One job_attempts row per reservation of this cycle, with the step it restarts from (a closing write: no
    reads here, see pipelined)."""
    if not jobs:
        return
    insert_rows(
        conn,
        JobAttempt,
        [
            dict(
                job_id=j.id,
                attempt=j.attempt,
                gpus=j.gpu_equivalents,
                reserved_at=now,
                running_at=None,
                ended_at=None,
                outcome="",
                reason="",
                restored_step=j.restored_step,
                committed_step=-1,
                kept_until=None,
            )
            for j in jobs
        ],
    )


def mark_attempt_running(conn: Connection, job: JobRecord, now: float) -> None:
    conn.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job.id, JobAttempt.attempt == job.attempt, JobAttempt.running_at.is_(None))
        .values(running_at=now)
    )


def _attempt_end_statement():
    """end_attempt's update with its values as parameters (b_job, b_attempt, b_now, b_outcome, b_reason): built
    once, for one attempt (end_attempt) or many in one executemany (end_attempts)."""
    att, ck = cast(Table, JobAttempt.__table__), cast(Table, Checkpoint.__table__)
    latest = (
        select(ck.c.step, ck.c.attempt, ck.c.created_at)
        .where(ck.c.job_id == bindparam("b_job"), ck.c.state == "COMMITTED")
        .order_by(ck.c.step.desc(), ck.c.committed_at.desc())
        .limit(1)
    )
    step = func.coalesce(latest.with_only_columns(ck.c.step).scalar_subquery(), -1)
    kept = latest.with_only_columns(
        case((ck.c.attempt == bindparam("b_attempt"), ck.c.created_at), else_=None)
    ).scalar_subquery()
    return (
        update(att)
        .where(att.c.job_id == bindparam("b_job"), att.c.attempt == bindparam("b_attempt"), att.c.ended_at.is_(None))
        .values(
            ended_at=bindparam("b_now"),
            outcome=bindparam("b_outcome"),
            reason=bindparam("b_reason"),
            committed_step=step,
            kept_until=kept,
        )
    )


_END_ATTEMPTS = _attempt_end_statement()
_MARK_RUNNING = (
    update(cast(Table, JobAttempt.__table__))
    .where(
        JobAttempt.__table__.c.job_id == bindparam("b_job"),
        JobAttempt.__table__.c.attempt == bindparam("b_attempt"),
        JobAttempt.__table__.c.running_at.is_(None),
    )
    .values(running_at=bindparam("b_now"))
)


def end_attempts(conn: Connection, ends: Sequence[tuple[JobRecord, str, str, float]]) -> None:
    """`end_attempt` without answers for many attempts, (job, outcome, reason, now) each: one statement, executed
    for all of them at once (a cycle's deferred writes)."""
    if ends:
        conn.execute(
            _END_ATTEMPTS,
            [
                dict(b_job=j.id, b_attempt=j.attempt, b_now=now, b_outcome=outcome, b_reason=reason[:2000])
                for j, outcome, reason, now in ends
            ],
        )


def mark_attempts_running(conn: Connection, items: Sequence[tuple[JobRecord, float]]) -> None:
    """`mark_attempt_running` for many attempts at once."""
    if items:
        conn.execute(_MARK_RUNNING, [dict(b_job=j.id, b_attempt=j.attempt, b_now=now) for j, now in items])


def end_attempt(
    conn: Connection, job: JobRecord, outcome: str, reason: str, now: float, answer: bool = True
) -> tuple[int, float | None]:
    """Close the job's current attempt: its end, and the committed step the next attempt restarts from with when
    this attempt reached it (None when the latest committed checkpoint is not this attempt's). Returns those two.
    One statement (a teardown is on the cycle's path): the latest commit is read by the update itself."""
    params = dict(b_job=job.id, b_attempt=job.attempt, b_now=now, b_outcome=outcome, b_reason=reason[:2000])
    if not answer:  # a deferred write, sent pipelined: nothing to read back
        conn.execute(_END_ATTEMPTS, params)
        return -1, None
    att = cast(Table, JobAttempt.__table__)
    row = conn.execute(_END_ATTEMPTS.returning(att.c.committed_step, att.c.kept_until), params).first()
    if row is None:  # no open attempt (already ended): nothing written
        got = latest_commits(conn, [job.id]).get(job.id, (-1, -1, 0.0))
        return got[0], got[2] if got[0] >= 0 and got[1] == job.attempt else None
    return int(row[0]), None if row[1] is None else float(row[1])


def request_checkpoint(conn: Connection, job_id: str, reason: str, now: float) -> tuple[str, float]:
    """Ask the job's ranks to checkpoint (the checkpoint coordinator answers their polls from this table and clears
    it when a checkpoint begun after it commits). An outstanding request is kept; returns (reason, requested_at)."""
    row = conn.execute(
        select(CheckpointRequest.reason, CheckpointRequest.requested_at).where(CheckpointRequest.job_id == job_id)
    ).first()
    if row is not None:
        return row.reason, row.requested_at
    conn.execute(insert(CheckpointRequest).values(job_id=job_id, reason=reason, requested_at=now))
    return reason, now


def service_endpoint(conn: Connection, name: str) -> tuple[str, dict[str, Any]] | None:
    row = conn.execute(
        select(ServiceEndpoint.address, ServiceEndpoint.detail).where(ServiceEndpoint.name == name)
    ).first()
    return None if row is None else (row.address, dict(row.detail or {}))


def outstanding_requests(conn: Connection, job_ids: Sequence[str]) -> set[str]:
    """The jobs among `job_ids` whose checkpoint request is not yet satisfied by a commit."""
    if not job_ids:
        return set()
    return set(conn.scalars(select(CheckpointRequest.job_id).where(CheckpointRequest.job_id.in_(list(job_ids)))))


def read_attempts(conn: Connection, job_ids: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """job_attempts rows by job, in attempt order."""
    stmt = select(*JobAttempt.__table__.c).order_by(JobAttempt.job_id, JobAttempt.attempt)
    if job_ids is not None:
        stmt = stmt.where(JobAttempt.job_id.in_(list(job_ids)))
    out: dict[str, list[Any]] = {}
    for row in conn.execute(stmt).mappings().all():
        out.setdefault(row["job_id"], []).append(row)
    return out


def mark_attempt_preempted(conn: Connection, job_id: str, attempt: int, by: str) -> None:
    """Record the gang an attempt was preempted for (job_attempts.preempted_by)."""
    conn.execute(
        update(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.attempt == attempt).values(preempted_by=by)
    )
