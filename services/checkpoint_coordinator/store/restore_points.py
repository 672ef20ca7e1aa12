"""The restore points of a job: its complete COMMITTED checkpoints that retention did not delete, newest first
(the order restores try them), and the read operations over them (`latest_checkpoint`, `list_checkpoints`).
"""

from __future__ import annotations

from sqlalchemy import Engine, func, or_, select

from db.models import (
    Checkpoint,
    CheckpointShard,
)
from services.common.errors import InvalidArgument, NotFound

from ._records import COMMITTED, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, CheckpointRecord, _record
from .jobs import _current_attempt


def _restore_points(job_id: str, current_attempt: int):
    """The job's complete COMMITTED checkpoints of attempts up to `current_attempt`, newest first (highest step,
    then latest commit). Complete: its shards are exactly ranks 0..n-1 (ranks are unique per checkpoint) and n is
    its world size (0 on rows older than revision 0005: unknown, any n). A checkpoint of a later attempt than the
    current one can only come from an unfenced write, and is never a restore point; nor is one whose files the
    coordinator's retention deleted (`deleted_at`, revision 0014: retention.py)."""
    stats = (
        select(
            CheckpointShard.checkpoint_id.label("cid"),
            func.count().label("n"),
            func.min(CheckpointShard.rank).label("lo"),
            func.max(CheckpointShard.rank).label("hi"),
        )
        .join(Checkpoint, Checkpoint.id == CheckpointShard.checkpoint_id)
        .where(Checkpoint.job_id == job_id, Checkpoint.state == COMMITTED, Checkpoint.deleted_at.is_(None))
        .group_by(CheckpointShard.checkpoint_id)
        .subquery()
    )
    return (
        select(Checkpoint)
        .join(stats, stats.c.cid == Checkpoint.id)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.state == COMMITTED,
            Checkpoint.attempt <= current_attempt,
            Checkpoint.deleted_at.is_(None),
            stats.c.lo == 0,
            stats.c.hi == stats.c.n - 1,
            or_(Checkpoint.world_size == 0, Checkpoint.world_size == stats.c.n),
        )
        .order_by(Checkpoint.step.desc(), Checkpoint.committed_at.desc(), Checkpoint.created_at.desc(), Checkpoint.id)
    )


def _records(conn, rows) -> list[CheckpointRecord]:
    """Checkpoint rows with their shards (one query), in the rows' order."""
    ids = [r.id for r in rows]
    shards: dict[str, list] = {i: [] for i in ids}
    if ids:
        for s in conn.execute(
            select(CheckpointShard)
            .where(CheckpointShard.checkpoint_id.in_(ids))
            .order_by(CheckpointShard.checkpoint_id, CheckpointShard.rank)
        ):
            shards[s.checkpoint_id].append(s)
    return [_record(r, shards[r.id]) for r in rows]


def latest_checkpoint(engine: Engine, job_id: str) -> CheckpointRecord:
    """The job's newest complete committed checkpoint (highest step, ties: latest committed_at), of any attempt up
    to the current one."""
    with engine.execution_options(readonly=True).begin() as conn:
        current = _current_attempt(conn, job_id)
        row = conn.execute(_restore_points(job_id, current).limit(1)).first()
        if row is None:
            raise NotFound(f"job {job_id[:80]!r} has no committed checkpoint")
        return _records(conn, [row])[0]


def list_checkpoints(
    engine: Engine, job_id: str, page_size: int = 0, page_token: str = ""
) -> tuple[list[CheckpointRecord], str]:
    """A page of the job's complete committed checkpoints, newest first (latest_checkpoint's order), and the
    token of the next page ("" after the last)."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    if not 0 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be in 0..{MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE}), got {page_size}")
    size = page_size or DEFAULT_PAGE_SIZE
    if page_token and not (page_token.isascii() and page_token.isdigit() and len(page_token) <= 9):
        raise InvalidArgument(f"page_token {page_token[:40]!r} is not one ListCheckpoints returned")
    offset = int(page_token or 0)
    with engine.execution_options(readonly=True).begin() as conn:
        current = _current_attempt(conn, job_id)
        rows = conn.execute(_restore_points(job_id, current).offset(offset).limit(size + 1)).all()
        records = _records(conn, rows[:size])
    return records, str(offset + size) if len(rows) > size else ""
