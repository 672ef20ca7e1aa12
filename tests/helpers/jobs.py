"""Job rows written straight into the ledger, for services tested without a scheduler (the checkpoint
coordinator fences on `jobs.attempt`)."""

from __future__ import annotations

import time

from sqlalchemy import insert, update

from db.engine import make_engine
from db.models import Job


def insert_job(db_url: str, job_id: str, *, attempt: int = 1, replicas: int = 2, gpus_per_replica: int = 1) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            insert(Job).values(
                id=job_id,
                name=job_id,
                state="RUNNING",
                replicas=replicas,
                gpus_per_replica=gpus_per_replica,
                command=["train"],
                attempt=attempt,
                submitted_at=time.time(),
            )
        )
    engine.dispose()


def set_world(db_url: str, job_id: str, ranks: int) -> None:
    """Make the job a gang of `ranks` ranks (replicas of one GPU): the world size the checkpoint coordinator reads
    from the ledger when the attempt has no allocations recorded."""
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            update(Job).where(Job.id == job_id).values(replicas=ranks, gpus_per_replica=1, procs_per_replica=0)
        )
    engine.dispose()


def set_attempt(db_url: str, job_id: str, attempt: int) -> None:
    """What a relaunch does to the job: a new attempt, which supersedes the ranks of the old one."""
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(attempt=attempt))
    engine.dispose()
