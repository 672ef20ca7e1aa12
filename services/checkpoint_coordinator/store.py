"""Checkpoint ledger operations: pure, synchronous database functions (no gRPC), one transaction each.

The servicer validates nothing itself; everything here raises `services.common.errors` exceptions.

The commit protocol (docs/design.md, "Checkpoints"): a checkpoint is PENDING from its begin (`begin_checkpoint`,
or implicitly the first `report_shard`) until all `world_size` ranks reported, when the same transaction marks
it COMMITTED. `abort_expired` marks ABORTED the PENDING ones past their deadline or of a superseded attempt.
Every write first locks the job row and reads `jobs.attempt` (fencing): a request of another attempt raises
FailedPrecondition, and any refusal raises before anything is written, so the transaction rolls back whole.

No number a client sends about the gang is believed: the world size is the number of ranks of the job's current
attempt in the ledger (`ledger_world_size`), a request's `world_size` only a cross-check (0: the ledger's); a
checkpoint commits with exactly one shard of each rank 0..N-1. Restores read only complete COMMITTED checkpoints
whose files retention did not delete (`latest_checkpoint`, `list_checkpoints`; retention.py), and `report_restore`
records what a rank restored from, checked against the ledger (`get_restore` reads it back with its one-line message).

Step agreement (`get_request` with a rank's step): while a request is outstanding, every rank reports the step it
has just completed at each poll (`checkpoint_step_reports`, one row per rank of the attempt); once every rank
0..N-1 has reported for the request, its target step is max(reported) + 1 (`checkpoint_requests.target_step`), the
step every rank checkpoints at (the argument: proto/phalanx/api/v1/checkpoint.proto, GetCheckpointRequest).

`checkpoint_policy` (and `get_request`, for the ranks' polls) measures the cluster's node failures and the
checkpoint cost and returns the job's Young/Daly interval (phalanx.core.checkpoint_policy; docs/design.md,
"Checkpoint interval policy").
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine, case, delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import (
    Allocation,
    Checkpoint,
    CheckpointRequest,
    CheckpointRestore,
    CheckpointShard,
    CheckpointStepReport,
    Job,
    Node,
    NodeEvent,
    ServiceEndpoint,
)
from phalanx.core import checkpoint_policy as cp
from phalanx.core.restore_account import restore_message
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.faults import fail_point

COMMITTED = "COMMITTED"
PENDING = "PENDING"
ABORTED = "ABORTED"
DEFAULT_DEADLINE_S = 600.0
MAX_DEADLINE_S = 7 * 24 * 3600.0
MAX_WORLD_SIZE = 1 << 20
MAX_JOB_ID = Job.__table__.c.id.type.length
MAX_CHECKSUM = CheckpointShard.__table__.c.checksum.type.length
MAX_CHECKPOINT_ID = Checkpoint.__table__.c.id.type.length
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


FATAL = "FATAL"  # node_events severity of a node loss (heartbeat lease expired) or a fatal GPU error


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


def new_checkpoint_id() -> str:
    return secrets.token_hex(8)


def _validate_job_step(job_id: str, attempt: int, step: int) -> None:
    if not job_id:
        raise InvalidArgument("job_id is required")
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    if step < 0:
        raise InvalidArgument(f"step must be >= 0, got {step}")


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


def _possible_job_id(job_id: str) -> bool:
    # Ids the jobs table cannot hold are unknown by definition (and PostgreSQL rejects NUL in text).
    return 0 < len(job_id) <= MAX_JOB_ID and "\x00" not in job_id


def _require_job(conn, job_id: str) -> None:
    if not _possible_job_id(job_id) or conn.scalar(select(Job.id).where(Job.id == job_id)) is None:
        raise NotFound(f"job {job_id[:80]!r} not found")


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
        _clear_requests(conn, job_id, ts)
    return CheckpointRecord(ckpt_id, job_id, attempt, step, ts, list(shards), COMMITTED, len(shards), 0.0, ts)


def _current_attempt(conn, job_id: str) -> int:
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    current = conn.scalar(select(Job.attempt).where(Job.id == job_id))
    if current is None:
        raise NotFound(f"job {job_id[:80]!r} not found")
    return int(current)


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


def _clear_requests(conn, job_id: str, begun_at: float) -> None:
    """A commit of a checkpoint begun at or after a request satisfies it; the ranks' step reports for it go too."""
    conn.execute(
        delete(CheckpointRequest).where(CheckpointRequest.job_id == job_id, CheckpointRequest.requested_at <= begun_at)
    )
    conn.execute(
        delete(CheckpointStepReport).where(
            CheckpointStepReport.job_id == job_id, CheckpointStepReport.requested_at <= begun_at
        )
    )


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
        .where(Allocation.job_id == job_id, Allocation.attempt == attempt, Allocation.kind != "hold")
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
            _clear_requests(conn, job_id, row.created_at)
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


def checkpoint_policy(engine: Engine, job_id: str) -> cp.CheckpointPolicy:
    """The job's suggested checkpoint interval and the measured figures behind it (docs/design.md, "Checkpoint
    interval policy")."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    with engine.execution_options(readonly=True).begin() as conn:
        if not _possible_job_id(job_id):
            raise NotFound(f"job {job_id[:80]!r} not found")
        current = conn.scalar(select(Job.attempt).where(Job.id == job_id))
        if current is None:
            raise NotFound(f"job {job_id[:80]!r} not found")
        return _policy(conn, job_id, current)


def _durations(conn, job_id: str | None, limit: int) -> list[float]:
    """committed_at - created_at of the latest `limit` COMMITTED checkpoints (of one job, or of any) that took
    measurable time: one recorded in a single call (RecordCheckpoint) has created_at == committed_at."""
    duration = Checkpoint.committed_at - Checkpoint.created_at
    query = select(duration).where(Checkpoint.state == COMMITTED, Checkpoint.committed_at > Checkpoint.created_at)
    if job_id is not None:
        query = query.where(Checkpoint.job_id == job_id)
    return [float(d) for d in conn.scalars(query.order_by(Checkpoint.committed_at.desc()).limit(limit))]


def _policy(conn, job_id: str, attempt: int) -> cp.CheckpointPolicy:
    """Measure the cluster's failures and the checkpoint cost, then compute the job's interval.

    failures: node_events of severity FATAL (the scheduler writes kind LOST when a heartbeat lease expires; fatal
    GPU errors arrive as FATAL health events); exposure: the sum over nodes of max(0, last_heartbeat -
    registered_at); nodes: the distinct nodes of the attempt's unreleased allocations (1 when none)."""
    events, seconds, cluster_durations = _cluster_figures(conn)
    nodes = (
        conn.scalar(
            select(func.count(func.distinct(Allocation.node_id))).where(
                Allocation.job_id == job_id, Allocation.attempt == attempt, Allocation.released_at.is_(None)
            )
        )
        or 0
    )
    return cp.compute_policy(
        events=int(events),
        node_hours=float(seconds) / cp.HOUR_S,
        nodes=max(1, int(nodes)),
        job_durations=_durations(conn, job_id, cp.JOB_COST_SAMPLES),
        cluster_durations=cluster_durations,
    )


# Every rank polls the policy (GetCheckpointRequest): the cluster-wide figures, which scan node_events and nodes,
# are shared by all of them and kept this long per database.
CLUSTER_FIGURES_TTL_S = 30.0
_cluster_cache: dict[str, tuple[float, tuple[int, float, list[float]]]] = {}  # key: (computed at, figures)
# While a request's step is agreed, every rank polls at every step: the polls share the job's policy too, for as
# long (GetCheckpointPolicy still computes it per call).
_poll_policy_cache: dict[tuple[str, str, int], tuple[float, cp.CheckpointPolicy]] = {}
POLL_POLICY_CACHE_MAX = 10_000


def _poll_policy(conn, job_id: str, attempt: int) -> cp.CheckpointPolicy:
    """The job's policy for a rank's poll (`_policy`), cached for CLUSTER_FIGURES_TTL_S per job and attempt."""
    key = (conn.engine.url.render_as_string(hide_password=True), job_id, attempt)
    now = time.monotonic()
    hit = _poll_policy_cache.get(key)
    if hit is not None and now - hit[0] < CLUSTER_FIGURES_TTL_S:
        return hit[1]
    policy = _policy(conn, job_id, attempt)
    if len(_poll_policy_cache) >= POLL_POLICY_CACHE_MAX:
        stale = [k for k, (at, _) in _poll_policy_cache.items() if now - at >= CLUSTER_FIGURES_TTL_S]
        for k in stale or list(_poll_policy_cache):
            del _poll_policy_cache[k]
    _poll_policy_cache[key] = (now, policy)
    return policy


def _cluster_figures(conn) -> tuple[int, float, list[float]]:
    """(FATAL node events, node-seconds alive, durations of the cluster's recent commits), cached briefly."""
    key = conn.engine.url.render_as_string(hide_password=True)
    now = time.monotonic()
    hit = _cluster_cache.get(key)
    if hit is not None and now - hit[0] < CLUSTER_FIGURES_TTL_S:  # the TTL in force now (a test may set 0)
        return hit[1]
    events = conn.scalar(select(func.count()).select_from(NodeEvent).where(NodeEvent.severity == FATAL)) or 0
    alive = Node.last_heartbeat - Node.registered_at
    seconds = conn.scalar(select(func.sum(case((alive > 0, alive), else_=0.0)))) or 0.0
    figures = (int(events), float(seconds), _durations(conn, None, cp.CLUSTER_COST_SAMPLES))
    _cluster_cache[key] = (now, figures)
    return figures


# -- restores -----------------------------------------------------------------------------------------------------


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


COORDINATOR_ENDPOINT = "checkpoint-coordinator"


def advertise(
    engine: Engine,
    address: str,
    checkpoint_dir: str = "",
    *,
    name: str = COORDINATOR_ENDPOINT,
    now: float | None = None,
) -> None:
    """Record where this coordinator is reached (and the checkpoint directory it serves), for a scheduler started
    without --checkpoint-coordinator. The last one to start wins."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    values = dict(
        address=address, detail={"checkpoint_dir": checkpoint_dir}, updated_at=time.time() if now is None else now
    )
    with engine.begin() as conn:
        dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(
            dialect_insert(ServiceEndpoint)
            .values(name=name, **values)
            .on_conflict_do_update(index_elements=["name"], set_=values)
        )
