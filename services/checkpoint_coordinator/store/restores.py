"""Restore reports: what each rank of an attempt restored from and which newer checkpoints it skipped, checked
against the ledger's restore points (`report_restore`), and read back with its one-line message (`get_restore`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Engine, delete, insert, select

from db.models import (
    CheckpointRestore,
)
from phalanx.core.restore_account import restore_message
from services.common.errors import InvalidArgument, NotFound

from ._records import MAX_CHECKPOINT_ID, MAX_REASON, MAX_SKIPPED
from .jobs import _current_attempt, _fence
from .restore_points import _restore_points


@dataclass(frozen=True)
class SkippedRecord:
    checkpoint_id: str
    reason: str
    step: int = -1


@dataclass(frozen=True)
class RestoreRecord:
    job_id: str
    attempt: int
    rank: int
    checkpoint_id: str
    step: int
    skipped: list[SkippedRecord]
    message: str
    reported_at: float

    @property
    def fell_back_from(self) -> int:
        return self.skipped[0].step if self.skipped else -1


@dataclass(frozen=True)
class RestoreStateRecord:
    job_id: str
    attempt: int
    step: int
    fell_back_from: int
    message: str
    consistent: bool
    ranks: list[RestoreRecord]


def _validate_restore(job_id: str, attempt: int, rank: int, checkpoint_id: str, skipped: list[SkippedRecord]) -> None:
    if not job_id:
        raise InvalidArgument("job_id is required")
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    if rank < 0:
        raise InvalidArgument(f"rank must be >= 0, got {rank}")
    if len(skipped) > MAX_SKIPPED:
        raise InvalidArgument(f"at most {MAX_SKIPPED} skipped checkpoints, got {len(skipped)}")
    seen: set[str] = set()
    for name in [checkpoint_id] + [s.checkpoint_id for s in skipped]:
        if len(name) > MAX_CHECKPOINT_ID or "\x00" in name:
            raise InvalidArgument(f"checkpoint id {name[:40]!r} is not a checkpoint id")
    for s in skipped:
        if not s.checkpoint_id:
            raise InvalidArgument("a skipped checkpoint needs its checkpoint_id")
        if s.checkpoint_id in seen or s.checkpoint_id == checkpoint_id:
            raise InvalidArgument(f"checkpoint {s.checkpoint_id!r} is listed twice")
        seen.add(s.checkpoint_id)
        if not s.reason.strip() or len(s.reason) > MAX_REASON or "\x00" in s.reason:
            raise InvalidArgument(
                f"skipped checkpoint {s.checkpoint_id!r}: reason is required, at most {MAX_REASON} characters, "
                "without NUL"
            )


def report_restore(
    engine: Engine,
    job_id: str,
    attempt: int,
    rank: int,
    checkpoint_id: str,
    skipped: list[SkippedRecord],
    *,
    now: float | None = None,
) -> RestoreRecord:
    """Record what `rank` of the current attempt restored from (`checkpoint_id`, "" for step 0) and the newer
    committed checkpoints it skipped, with why. Nothing the client says is taken on trust: fenced like every
    write, the rank must be one of the ledger's, the checkpoints must be the job's complete committed ones, and
    the skipped ones exactly those newer than the one restored (every one, when it started from step 0). Steps
    come from the ledger. The rank's earlier report of this attempt is replaced."""
    _validate_restore(job_id, attempt, rank, checkpoint_id, skipped)
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        world = _fence(conn, job_id, attempt)
        if rank >= world:
            raise InvalidArgument(
                f"rank must be in 0..{world - 1} for job {job_id[:80]!r} attempt {attempt}, got {rank}"
            )
        # The newest len(skipped) + 1 restore points: the skipped ones, then the one restored (or none at all).
        newest = conn.execute(_restore_points(job_id, attempt).limit(len(skipped) + 1)).all()
        named = {s.checkpoint_id for s in skipped}
        head = {r.id for r in newest[: len(skipped)]}
        if head != named:
            stray = sorted(named - head)
            raise InvalidArgument(
                f"skipped checkpoint {stray[0][:40]!r} is not one of the {len(skipped)} newest complete committed "
                f"checkpoints of job {job_id[:80]!r}: a restore skips only checkpoints newer than the one it "
                "restores, none left out"
            )
        older = newest[len(skipped) :]
        if checkpoint_id:
            if not older or older[0].id != checkpoint_id:
                want = f"{older[0].id} (step {older[0].step})" if older else "none"
                raise InvalidArgument(
                    f"checkpoint {checkpoint_id[:40]!r} is not the newest complete committed checkpoint of job "
                    f"{job_id[:80]!r} after the skipped ones (that is {want})"
                )
            step = int(older[0].step)
        else:
            if older:
                raise InvalidArgument(
                    f"job {job_id[:80]!r} has a committed checkpoint {older[0].id} (step {older[0].step}) newer than "
                    "step 0 that the report neither restores nor skips"
                )
            step = -1
        listed = [
            SkippedRecord(r.id, next(s.reason for s in skipped if s.checkpoint_id == r.id), int(r.step))
            for r in newest
            if r.id in named
        ]
        message = restore_message(step, listed)
        values = dict(
            checkpoint_id=checkpoint_id,
            step=step,
            message=message,
            reported_at=ts,
            skipped=[{"checkpoint_id": s.checkpoint_id, "step": s.step, "reason": s.reason} for s in listed],
        )
        conn.execute(
            delete(CheckpointRestore).where(
                CheckpointRestore.job_id == job_id, CheckpointRestore.attempt == attempt, CheckpointRestore.rank == rank
            )
        )
        conn.execute(insert(CheckpointRestore).values(job_id=job_id, attempt=attempt, rank=rank, **values))
    return RestoreRecord(job_id, attempt, rank, checkpoint_id, step, listed, message, ts)


def _restore_record(row) -> RestoreRecord:
    skipped = [
        SkippedRecord(str(s.get("checkpoint_id", "")), str(s.get("reason", "")), int(s.get("step", -1)))
        for s in (row.skipped or [])
        if isinstance(s, dict)
    ]
    return RestoreRecord(
        row.job_id, row.attempt, row.rank, row.checkpoint_id, int(row.step), skipped, row.message, row.reported_at
    )


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def get_restore(engine: Engine, job_id: str, attempt: int | None = None) -> RestoreStateRecord:
    """What `attempt` (None: the job's current one) restored from, over the ranks that reported."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    if attempt is not None and attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    with engine.execution_options(readonly=True).begin() as conn:
        current = _current_attempt(conn, job_id)
        attempt = current if attempt is None else attempt
        rows = conn.execute(
            select(CheckpointRestore)
            .where(CheckpointRestore.job_id == job_id, CheckpointRestore.attempt == attempt)
            .order_by(CheckpointRestore.rank)
        ).all()
    if not rows:
        raise NotFound(f"job {job_id[:80]!r} attempt {attempt} has no restore report")
    ranks = [_restore_record(r) for r in rows]
    groups: dict[str, list[RestoreRecord]] = {}
    for r in ranks:
        groups.setdefault(r.checkpoint_id, []).append(r)
    first = ranks[0]
    if len(groups) == 1:
        # Ranks that verify every shard (phalanx.train's default) skip the same ones; show the fullest account.
        fullest = max(ranks, key=lambda r: len(r.skipped))
        return RestoreStateRecord(job_id, attempt, first.step, fullest.fell_back_from, fullest.message, True, ranks)
    parts = [
        f"{_rank_list([r.rank for r in members])}: {max(members, key=lambda r: len(r.skipped)).message}"
        for members in sorted(groups.values(), key=lambda m: m[0].rank)
    ]
    fell_back = max((r.fell_back_from for r in ranks), default=-1)
    return RestoreStateRecord(
        job_id,
        attempt,
        first.step,
        fell_back,
        "ranks restored different checkpoints: " + "; ".join(parts),
        False,
        ranks,
    )
