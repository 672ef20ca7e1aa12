"""Checkpoint ledger operations: pure, synchronous database functions (no gRPC), one transaction each.

The servicer validates nothing itself; everything here raises `services.common.errors` exceptions, so the
multi-rank commit protocol can later reuse these functions from other RPCs.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine, insert, select

from db.models import Checkpoint, CheckpointShard, Job
from services.common.errors import InvalidArgument, NotFound

COMMITTED = "COMMITTED"
MAX_JOB_ID = Job.__table__.c.id.type.length
MAX_CHECKSUM = CheckpointShard.__table__.c.checksum.type.length


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    uri: str
    size_bytes: int = 0
    checksum: str = ""


@dataclass(frozen=True)
class CheckpointRecord:
    id: str
    job_id: str
    attempt: int
    step: int
    committed_at: float
    shards: list[ShardRecord] = field(default_factory=list)


def new_checkpoint_id() -> str:
    return secrets.token_hex(8)


def validate(job_id: str, attempt: int, step: int, shards: list[ShardRecord]) -> None:
    """Raise InvalidArgument, with the reason, for a checkpoint that cannot be recorded as given."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")
    if not shards:
        raise InvalidArgument("a checkpoint needs at least one shard")
    seen: set[int] = set()
    for shard in shards:
        if shard.rank < 0:
            raise InvalidArgument(f"shard rank must be >= 0, got {shard.rank}")
        if shard.rank in seen:
            raise InvalidArgument(f"duplicate shard rank {shard.rank}")
        seen.add(shard.rank)
        if shard.size_bytes < 0:
            raise InvalidArgument(f"shard {shard.rank}: size_bytes must be >= 0, got {shard.size_bytes}")
        if not shard.uri.strip():
            raise InvalidArgument(f"shard {shard.rank}: uri is required")
        if "\x00" in shard.uri or "\x00" in shard.checksum:
            raise InvalidArgument(f"shard {shard.rank}: uri and checksum must not contain NUL characters")
        if len(shard.checksum) > MAX_CHECKSUM:
            raise InvalidArgument(f"shard {shard.rank}: checksum longer than {MAX_CHECKSUM} characters")
    if seen != set(range(len(shards))):
        missing = sorted(set(range(len(shards))) - seen)
        raise InvalidArgument(
            f"shard ranks must be exactly 0..{len(shards) - 1} for {len(shards)} shards; missing {missing}"
        )


def _possible_job_id(job_id: str) -> bool:
    # Ids the jobs table cannot hold are unknown by definition (and PostgreSQL rejects NUL in text).
    return 0 < len(job_id) <= MAX_JOB_ID and "\x00" not in job_id


def _require_job(conn, job_id: str) -> None:
    if not _possible_job_id(job_id) or conn.scalar(select(Job.id).where(Job.id == job_id)) is None:
        raise NotFound(f"job {job_id!r} not found")


def record_checkpoint(
    engine: Engine, job_id: str, attempt: int, step: int, shards: list[ShardRecord], *, now: float | None = None
) -> CheckpointRecord:
    """Validate, then write the checkpoint row and every shard row as COMMITTED in one transaction."""
    validate(job_id, attempt, step, shards)
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id!r} not found")
    ts = time.time() if now is None else now
    shards = sorted(shards, key=lambda s: s.rank)
    ckpt_id = new_checkpoint_id()
    with engine.begin() as conn:
        _require_job(conn, job_id)
        conn.execute(
            insert(Checkpoint).values(
                id=ckpt_id, job_id=job_id, attempt=attempt, step=step, state=COMMITTED, created_at=ts, committed_at=ts
            )
        )
        conn.execute(
            insert(CheckpointShard),
            [
                {"checkpoint_id": ckpt_id, "rank": s.rank, "uri": s.uri, "size_bytes": s.size_bytes, "checksum": s.checksum}
                for s in shards
            ],
        )
    return CheckpointRecord(ckpt_id, job_id, attempt, step, ts, list(shards))


def latest_checkpoint(engine: Engine, job_id: str) -> CheckpointRecord:
    """The job's committed checkpoint with the highest step (ties: latest committed_at)."""
    with engine.execution_options(readonly=True).begin() as conn:
        _require_job(conn, job_id)
        row = conn.execute(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.state == COMMITTED)
            .order_by(Checkpoint.step.desc(), Checkpoint.committed_at.desc(), Checkpoint.created_at.desc())
            .limit(1)
        ).first()
        if row is None:
            raise NotFound(f"job {job_id!r} has no committed checkpoint")
        shard_rows = conn.execute(
            select(CheckpointShard).where(CheckpointShard.checkpoint_id == row.id).order_by(CheckpointShard.rank)
        ).all()
    shards = [ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum) for s in shard_rows]
    return CheckpointRecord(row.id, row.job_id, row.attempt, row.step, row.committed_at or 0.0, shards)
