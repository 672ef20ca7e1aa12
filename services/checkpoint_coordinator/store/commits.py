"""Writing checkpoints: the commit protocol (begin, report shards, commit once every rank reported; or record a
whole checkpoint in one call) and the sweep that aborts the PENDING ones past their deadline or attempt.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, delete, insert, or_, select, update

from db.models import (
    Checkpoint,
    CheckpointRequest,
    CheckpointShard,
    CheckpointStepReport,
    Job,
)
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.faults import fail_point

from ._records import (
    ABORTED,
    COMMITTED,
    DEFAULT_DEADLINE_S,
    MAX_CHECKSUM,
    MAX_DEADLINE_S,
    MAX_WORLD_SIZE,
    PENDING,
    CheckpointRecord,
    ShardRecord,
    _possible_job_id,
    _record,
    _shard_rows,
    _validate_job_step,
    new_checkpoint_id,
)
from .jobs import _fence


def validate(job_id: str, attempt: int, step: int, shards: list[ShardRecord]) -> None:
    """Raise InvalidArgument, with the reason, for a checkpoint that cannot be recorded as given."""
    _validate_job_step(job_id, attempt, step)
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
    for shard in shards:
        if not shard.checksum:
            raise InvalidArgument(f"shard {shard.rank}: checksum is required")


def record_checkpoint(
    engine: Engine, job_id: str, attempt: int, step: int, shards: list[ShardRecord], *, now: float | None = None
) -> CheckpointRecord:
    """Validate, then write the checkpoint row and every shard row as COMMITTED in one transaction.

    Fenced like every write (the job's current attempt, RUNNING), and the shards must be exactly ranks 0..N-1 for
    the ledger's world size N."""
    validate(job_id, attempt, step, shards)
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    ts = time.time() if now is None else now
    shards = sorted(shards, key=lambda s: s.rank)
    ckpt_id = new_checkpoint_id()
    with engine.begin() as conn:
        world = _fence(conn, job_id, attempt)
        if len(shards) != world:
            raise InvalidArgument(
                f"job {job_id[:80]!r} attempt {attempt} has {world} ranks in the ledger: a checkpoint needs exactly "
                f"one shard of each rank 0..{world - 1}, got {len(shards)} shards"
            )
        conn.execute(
            insert(Checkpoint).values(
                id=ckpt_id,
                job_id=job_id,
                attempt=attempt,
                step=step,
                state=COMMITTED,
                created_at=ts,
                committed_at=ts,
                world_size=len(shards),
                message="",
            )
        )
        conn.execute(
            insert(CheckpointShard),
            [
                {
                    "checkpoint_id": ckpt_id,
                    "rank": s.rank,
                    "uri": s.uri,
                    "size_bytes": s.size_bytes,
                    "checksum": s.checksum,
                }
                for s in shards
            ],
        )
        _clear_requests(conn, job_id, attempt, step, ts)
    return CheckpointRecord(ckpt_id, job_id, attempt, step, ts, list(shards), COMMITTED, len(shards), 0.0, ts)


def _clear_requests(conn, job_id: str, attempt: int, step: int, begun_at: float) -> None:
    """A commit of a checkpoint begun at or after a request satisfies it; the ranks' step reports for it go too.

    Except a request whose step the committing attempt's ranks have agreed (target_step) after the committed one:
    it stands, with its reports, until a checkpoint at or past that step commits. A decided target is stable, and a
    rank that knows it checkpoints at it without asking again (should_checkpoint polls once per poll slot), while
    a rank that does not know it yet polls at that step: clearing the request under them (a checkpoint the ranks
    took anyway, e.g. every N steps, just before the agreed step) would split the gang at the agreed step."""
    not_agreed_later = or_(  # NULL-safe: not (target_attempt == attempt and target_step > step)
        CheckpointRequest.target_step.is_(None),
        CheckpointRequest.target_attempt.is_(None),
        CheckpointRequest.target_attempt != attempt,
        CheckpointRequest.target_step <= step,
    )
    conn.execute(
        delete(CheckpointRequest).where(
            CheckpointRequest.job_id == job_id, CheckpointRequest.requested_at <= begun_at, not_agreed_later
        )
    )
    kept = conn.scalar(select(CheckpointRequest.requested_at).where(CheckpointRequest.job_id == job_id))
    reports = delete(CheckpointStepReport).where(
        CheckpointStepReport.job_id == job_id, CheckpointStepReport.requested_at <= begun_at
    )
    if kept is not None:
        reports = reports.where(CheckpointStepReport.requested_at != kept)
    conn.execute(reports)


def _validate_target(job_id: str, attempt: int, step: int, world_size: int, deadline_s: float) -> None:
    _validate_job_step(job_id, attempt, step)
    if not 0 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"world_size must be in 0..{MAX_WORLD_SIZE} (0: the ledger's), got {world_size}")
    if not 0 <= deadline_s <= MAX_DEADLINE_S:  # also refuses NaN
        raise InvalidArgument(f"deadline_s must be in 0..{MAX_DEADLINE_S:.0f} (0: default), got {deadline_s}")


def _check_rank(shard: ShardRecord, world_size: int) -> None:
    if not 0 <= shard.rank < world_size:
        raise InvalidArgument(
            f"shard rank must be in 0..{world_size - 1} for world_size {world_size}, got {shard.rank}"
        )


def _validate_shard(shard: ShardRecord, world_size: int) -> None:
    """The shard's own fields; its rank against the claimed world_size when one is given (0: checked against the
    ledger's in the transaction)."""
    if shard.rank < 0:
        raise InvalidArgument(f"shard rank must be >= 0, got {shard.rank}")
    if world_size:
        _check_rank(shard, world_size)
    if shard.size_bytes < 0:
        raise InvalidArgument(f"shard {shard.rank}: size_bytes must be >= 0, got {shard.size_bytes}")
    if not shard.uri.strip():
        raise InvalidArgument(f"shard {shard.rank}: uri is required")
    if "\x00" in shard.uri or "\x00" in shard.checksum:
        raise InvalidArgument(f"shard {shard.rank}: uri and checksum must not contain NUL characters")
    if not shard.checksum:
        raise InvalidArgument(f"shard {shard.rank}: checksum is required")
    if len(shard.checksum) > MAX_CHECKSUM:
        raise InvalidArgument(f"shard {shard.rank}: checksum longer than {MAX_CHECKSUM} characters")


def _check_world(job_id: str, attempt: int, claimed: int, world: int) -> None:
    """A client's world_size is a cross-check only: 0 takes the ledger's, any other value must equal it."""
    if claimed and claimed != world:
        raise InvalidArgument(
            f"world_size {claimed} does not match job {job_id[:80]!r} attempt {attempt}: the ledger has {world} "
            "ranks (send 0 to use the ledger's)"
        )


def _open(conn, job_id: str, attempt: int, step: int):
    """The newest checkpoint row for (job, attempt, step), or None."""
    return conn.execute(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.attempt == attempt, Checkpoint.step == step)
        .order_by(Checkpoint.created_at.desc())
        .limit(1)
    ).first()


def _usable(row, world_size: int, now: float, job_id: str, step: int):
    """Refuse a report or begin against an aborted, expired or differently-sized checkpoint; return the row."""
    if row.state == ABORTED:
        raise FailedPrecondition(f"checkpoint {row.id} of job {job_id[:80]!r} step {step} was aborted: {row.message}")
    if row.state == PENDING and row.deadline_at is not None and row.deadline_at < now:
        raise FailedPrecondition(
            f"checkpoint {row.id} of job {job_id[:80]!r} step {step} missed its deadline and is aborted"
        )
    if row.world_size and row.world_size != world_size:
        raise FailedPrecondition(
            f"checkpoint {row.id} of job {job_id[:80]!r} step {step} has world_size {row.world_size}, not {world_size}"
        )
    return row


def _create(conn, job_id: str, attempt: int, step: int, world_size: int, deadline_s: float, now: float):
    ckpt_id = new_checkpoint_id()
    deadline_at = now + (deadline_s or DEFAULT_DEADLINE_S)
    conn.execute(
        insert(Checkpoint).values(
            id=ckpt_id,
            job_id=job_id,
            attempt=attempt,
            step=step,
            state=PENDING,
            created_at=now,
            committed_at=None,
            world_size=world_size,
            deadline_at=deadline_at,
            message="",
        )
    )
    return conn.execute(select(Checkpoint).where(Checkpoint.id == ckpt_id)).first()


def begin_checkpoint(
    engine: Engine,
    job_id: str,
    attempt: int,
    step: int,
    world_size: int,
    deadline_s: float = 0.0,
    *,
    now: float | None = None,
) -> CheckpointRecord:
    """Open a PENDING checkpoint for (job, attempt, step) with the ledger's world size (`world_size` 0, or equal
    to it); the same begin again returns the one already open."""
    _validate_target(job_id, attempt, step, world_size, deadline_s)
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        world = _fence(conn, job_id, attempt)
        _check_world(job_id, attempt, world_size, world)
        row = _open(conn, job_id, attempt, step)
        if row is not None:
            row = _usable(row, world, ts, job_id, step)
        else:
            row = _create(conn, job_id, attempt, step, world, deadline_s, ts)
        return _record(row, _shard_rows(conn, row.id))


def report_shard(
    engine: Engine,
    job_id: str,
    attempt: int,
    step: int,
    world_size: int,
    shard: ShardRecord,
    deadline_s: float = 0.0,
    *,
    now: float | None = None,
) -> CheckpointRecord:
    """Record one rank's shard (beginning the checkpoint if none is open) and commit once every rank 0..N-1 of the
    ledger's world size N reported. The same shard again is a no-op; a different one for a rank that already
    reported is FailedPrecondition."""
    _validate_target(job_id, attempt, step, world_size, deadline_s)
    _validate_shard(shard, world_size)
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        world = _fence(conn, job_id, attempt)
        _check_world(job_id, attempt, world_size, world)
        _check_rank(shard, world)
        row = _open(conn, job_id, attempt, step)
        if row is None:
            row = _create(conn, job_id, attempt, step, world, deadline_s, ts)
        else:
            row = _usable(row, world, ts, job_id, step)
        existing = conn.execute(
            select(CheckpointShard).where(CheckpointShard.checkpoint_id == row.id, CheckpointShard.rank == shard.rank)
        ).first()
        if existing is not None:
            if (existing.uri, existing.checksum, existing.size_bytes) != (shard.uri, shard.checksum, shard.size_bytes):
                raise FailedPrecondition(
                    f"checkpoint {row.id} of job {job_id[:80]!r} step {step} already has a different shard for rank "
                    f"{shard.rank} ({existing.uri}, {existing.checksum}); a rank reports one shard per checkpoint"
                )
            return _record(row, _shard_rows(conn, row.id))  # the same report again: idempotent
        if row.state == COMMITTED:  # a committed checkpoint has every shard; unreachable unless world_size was 0
            raise FailedPrecondition(f"checkpoint {row.id} of job {job_id[:80]!r} step {step} is already committed")
        conn.execute(
            insert(CheckpointShard).values(
                checkpoint_id=row.id,
                rank=shard.rank,
                uri=shard.uri,
                size_bytes=shard.size_bytes,
                checksum=shard.checksum,
            )
        )
        shard_rows = _shard_rows(conn, row.id)
        if [s.rank for s in shard_rows] == list(range(row.world_size)):
            conn.execute(
                update(Checkpoint)
                .where(Checkpoint.id == row.id, Checkpoint.state == PENDING)
                .values(state=COMMITTED, committed_at=ts)
            )
            _clear_requests(conn, job_id, attempt, step, row.created_at)
            fail_point("checkpoint.commit")
            row = conn.execute(select(Checkpoint).where(Checkpoint.id == row.id)).first()
        return _record(row, shard_rows)


def abort_expired(engine: Engine, *, now: float | None = None) -> int:
    """Mark ABORTED every PENDING checkpoint past its deadline or of a superseded attempt; returns how many."""
    ts = time.time() if now is None else now
    # Look first with a read-only transaction: on SQLite a write transaction takes the database's one write lock.
    with engine.execution_options(readonly=True).begin() as conn:
        if conn.scalar(select(Checkpoint.id).where(Checkpoint.state == PENDING).limit(1)) is None:
            return 0
    with engine.begin() as conn:
        late = conn.execute(
            update(Checkpoint)
            .where(Checkpoint.state == PENDING, Checkpoint.deadline_at < ts)
            .values(state=ABORTED, message="deadline passed before every rank reported its shard")
        ).rowcount
        superseded = conn.execute(
            update(Checkpoint)
            .where(
                Checkpoint.state == PENDING,
                Checkpoint.attempt != select(Job.attempt).where(Job.id == Checkpoint.job_id).scalar_subquery(),
            )
            .values(state=ABORTED, message="the attempt was superseded")
        ).rowcount
        ended = conn.execute(
            update(Checkpoint)
            .where(
                Checkpoint.state == PENDING,
                select(Job.state).where(Job.id == Checkpoint.job_id).scalar_subquery() != "RUNNING",
            )
            .values(state=ABORTED, message="the attempt ended before every rank reported its shard")
        ).rowcount
    return late + superseded + ended
