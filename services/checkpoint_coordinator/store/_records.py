"""The checkpoint store's shared vocabulary: states, limits, the checkpoint and shard records, and the few
validation helpers every operation uses. Imports nothing of the store, so every other room can import it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, String, select

from db.models import (
    Checkpoint,
    CheckpointShard,
    Job,
)
from services.common.errors import InvalidArgument

COMMITTED = "COMMITTED"
PENDING = "PENDING"
ABORTED = "ABORTED"
DEFAULT_DEADLINE_S = 600.0
MAX_DEADLINE_S = 7 * 24 * 3600.0
MAX_WORLD_SIZE = 1 << 20


def _declared_length(column: ColumnElement[str]) -> int:
    """The length a String column is declared with (db.models): the longest value the database keeps."""
    if not isinstance(column.type, String) or column.type.length is None:
        raise TypeError(f"column {column} is not a String of a declared length")
    return column.type.length


MAX_JOB_ID = _declared_length(Job.__table__.c.id)
MAX_CHECKSUM = _declared_length(CheckpointShard.__table__.c.checksum)
MAX_CHECKPOINT_ID = _declared_length(Checkpoint.__table__.c.id)
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_SKIPPED = 100
MAX_REASON = 1000


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
    state: str = COMMITTED
    world_size: int = 0
    deadline_at: float = 0.0
    created_at: float = 0.0
    message: str = ""


def new_checkpoint_id() -> str:
    return secrets.token_hex(8)


def _validate_job_step(job_id: str, attempt: int, step: int) -> None:
    if not job_id:
        raise InvalidArgument("job_id is required")
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")


def _possible_job_id(job_id: str) -> bool:
    # Ids the jobs table cannot hold are unknown by definition (and PostgreSQL rejects NUL in text).
    return 0 < len(job_id) <= MAX_JOB_ID and "\x00" not in job_id


def _record(row, shard_rows) -> CheckpointRecord:
    shards = [ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum) for s in shard_rows]
    return CheckpointRecord(
        row.id,
        row.job_id,
        row.attempt,
        row.step,
        row.committed_at or 0.0,
        shards,
        row.state,
        row.world_size,
        row.deadline_at or 0.0,
        row.created_at,
        row.message,
    )


def _shard_rows(conn, ckpt_id: str):
    return conn.execute(
        select(CheckpointShard).where(CheckpointShard.checkpoint_id == ckpt_id).order_by(CheckpointShard.rank)
    ).all()
