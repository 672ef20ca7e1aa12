"""Goodput from the ledger: job_attempts rows through phalanx.core.goodput, per job and for the cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select

from db.models import Job
from phalanx.api.v1 import common_pb2
from phalanx.core.goodput import AttemptTimes, Goodput, account_job

from . import ledger
from .state import gpu_equivalents


def attempt_times(rows: Sequence[Any]) -> list[AttemptTimes]:
    return [
        AttemptTimes(
            attempt=r["attempt"],
            gpus=r["gpus"],
            reserved_at=r["reserved_at"],
            running_at=r["running_at"],
            ended_at=r["ended_at"],
            outcome=r["outcome"] or "",
            kept_until=r["kept_until"],
        )
        for r in rows
    ]


def job_goodput(job: Any, attempts: Sequence[Any], now: float) -> Goodput:
    """`job`: a jobs row (mapping); `attempts`: its job_attempts rows in order."""
    gpus = gpu_equivalents(job["replicas"], job["gpus_per_replica"], job["mig_profile"] or "", job["gpu_milli"] or 0)
    finished = job["finished_at"] if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None
    return account_job(job["submitted_at"], gpus, attempt_times(attempts), now, finished_at=finished)


def read_goodput(
    conn: Connection,
    now: float,
    *,
    job_ids: Sequence[str] | None = None,
    since: float = 0.0,
    limit: int = 100,
    tenant: str | None = None,
) -> tuple[Goodput, list[tuple[Any, Goodput, int]], int]:
    """(the total over every job submitted since `since`, the newest `limit` of them with theirs and their attempt
    counts, how many jobs the total counts). `tenant`: only that tenant's jobs (the total too)."""
    stmt = select(*Job.__table__.c).where(Job.submitted_at >= since).order_by(Job.submitted_at.desc(), Job.id.desc())
    if job_ids is not None:
        stmt = stmt.where(Job.id.in_(list(job_ids)))
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    jobs = list(conn.execute(stmt).mappings())
    if tenant is not None and job_ids is None:
        job_ids = [j["id"] for j in jobs]
    attempts = ledger.read_attempts(conn, None if job_ids is None else list(job_ids))
    total, listed = Goodput(), []
    for i, job in enumerate(jobs):
        rows = attempts.get(job["id"], [])
        g = job_goodput(job, rows, now)
        total += g
        if i < limit:
            listed.append((job, g, len(rows)))
    return total, listed, len(jobs)


def to_proto(g: Goodput) -> common_pb2.Goodput:
    return common_pb2.Goodput(
        allocated=g.allocated,
        productive=g.productive,
        rollback=g.rollback,
        restart=g.restart,
        waiting=g.waiting,
        ratio=g.ratio,
    )
