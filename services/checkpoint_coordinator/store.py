"""Checkpoint ledger operations: pure, synchronous database functions (no gRPC), one transaction each.

The servicer validates nothing itself; everything here raises `services.common.errors` exceptions.

The commit protocol (docs/design.md, "Checkpoints"): a checkpoint is PENDING from its begin (`begin_checkpoint`,
or implicitly the first `report_shard`) until all `world_size` ranks reported, when the same transaction marks
it COMMITTED. `abort_expired` marks ABORTED the PENDING ones past their deadline or of a superseded attempt.
Every write first locks the job row and reads `jobs.attempt` (fencing): a request of another attempt raises
FailedPrecondition, and any refusal raises before anything is written, so the transaction rolls back whole.

`checkpoint_policy` (and `get_request`, for the ranks' polls) measures the cluster's node failures and the
checkpoint cost and returns the job's Young/Daly interval (phalanx.core.checkpoint_policy; docs/design.md,
"Checkpoint interval policy").
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine, case, delete, func, insert, select, update

from db.models import ServiceEndpoint, Allocation, Checkpoint, CheckpointRequest, CheckpointShard, Job, Node, NodeEvent
from phalanx.core import checkpoint_policy as cp
from services.common.faults import fail_point
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

COMMITTED = "COMMITTED"
PENDING = "PENDING"
ABORTED = "ABORTED"
DEFAULT_DEADLINE_S = 600.0
MAX_DEADLINE_S = 7 * 24 * 3600.0
MAX_WORLD_SIZE = 1 << 20
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


def _possible_job_id(job_id: str) -> bool:
    # Ids the jobs table cannot hold are unknown by definition (and PostgreSQL rejects NUL in text).
    return 0 < len(job_id) <= MAX_JOB_ID and "\x00" not in job_id


def _require_job(conn, job_id: str) -> None:
    if not _possible_job_id(job_id) or conn.scalar(select(Job.id).where(Job.id == job_id)) is None:
        raise NotFound(f"job {job_id[:80]!r} not found")


def record_checkpoint(
    engine: Engine, job_id: str, attempt: int, step: int, shards: list[ShardRecord], *, now: float | None = None
) -> CheckpointRecord:
    """Validate, then write the checkpoint row and every shard row as COMMITTED in one transaction."""
    validate(job_id, attempt, step, shards)
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    ts = time.time() if now is None else now
    shards = sorted(shards, key=lambda s: s.rank)
    ckpt_id = new_checkpoint_id()
    with engine.begin() as conn:
        _require_job(conn, job_id)
        conn.execute(
            insert(Checkpoint).values(
                id=ckpt_id, job_id=job_id, attempt=attempt, step=step, state=COMMITTED, created_at=ts, committed_at=ts,
                world_size=len(shards), message="",
            )
        )
        conn.execute(
            insert(CheckpointShard),
            [
                {"checkpoint_id": ckpt_id, "rank": s.rank, "uri": s.uri, "size_bytes": s.size_bytes, "checksum": s.checksum}
                for s in shards
            ],
        )
        _clear_requests(conn, job_id, ts)
    return CheckpointRecord(ckpt_id, job_id, attempt, step, ts, list(shards), COMMITTED, len(shards), 0.0, ts)


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
            raise NotFound(f"job {job_id[:80]!r} has no committed checkpoint")
        shard_rows = conn.execute(
            select(CheckpointShard).where(CheckpointShard.checkpoint_id == row.id).order_by(CheckpointShard.rank)
        ).all()
    return _record(row, shard_rows)


def _record(row, shard_rows) -> CheckpointRecord:
    shards = [ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum) for s in shard_rows]
    return CheckpointRecord(
        row.id, row.job_id, row.attempt, row.step, row.committed_at or 0.0, shards, row.state, row.world_size,
        row.deadline_at or 0.0, row.created_at, row.message,
    )


def _shard_rows(conn, ckpt_id: str):
    return conn.execute(
        select(CheckpointShard).where(CheckpointShard.checkpoint_id == ckpt_id).order_by(CheckpointShard.rank)
    ).all()


def _clear_requests(conn, job_id: str, begun_at: float) -> None:
    """A commit of a checkpoint begun at or after a request satisfies it."""
    conn.execute(
        delete(CheckpointRequest).where(CheckpointRequest.job_id == job_id, CheckpointRequest.requested_at <= begun_at)
    )


def _validate_target(job_id: str, attempt: int, step: int, world_size: int, deadline_s: float) -> None:
    _validate_job_step(job_id, attempt, step)
    if not 0 < world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
    if not 0 <= deadline_s <= MAX_DEADLINE_S:  # also refuses NaN
        raise InvalidArgument(f"deadline_s must be in 0..{MAX_DEADLINE_S:.0f} (0: default), got {deadline_s}")


def _validate_shard(shard: ShardRecord, world_size: int) -> None:
    if not 0 <= shard.rank < world_size:
        raise InvalidArgument(
            f"shard rank must be in 0..{world_size - 1} for world_size {world_size}, got {shard.rank}"
        )
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


def _fence(conn, job_id: str, attempt: int) -> None:
    """Lock the job row (PostgreSQL: FOR UPDATE; SQLite: BEGIN IMMEDIATE already holds the write lock) and refuse
    any attempt but the job's current one, and the current one once the scheduler tore it down (the job is no
    longer RUNNING: requeued, or finished). The teardown writes that row in the transaction that closes the
    attempt, so a commit lands before it (and counts for it) or is refused."""
    if not _possible_job_id(job_id):
        raise NotFound(f"job {job_id[:80]!r} not found")
    row = conn.execute(select(Job.attempt, Job.state).where(Job.id == job_id).with_for_update()).first()
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
            id=ckpt_id, job_id=job_id, attempt=attempt, step=step, state=PENDING, created_at=now, committed_at=None,
            world_size=world_size, deadline_at=deadline_at, message="",
        )
    )
    return conn.execute(select(Checkpoint).where(Checkpoint.id == ckpt_id)).first()


def begin_checkpoint(
    engine: Engine, job_id: str, attempt: int, step: int, world_size: int, deadline_s: float = 0.0,
    *, now: float | None = None,
) -> CheckpointRecord:
    """Open a PENDING checkpoint for (job, attempt, step); the same begin again returns the one already open."""
    _validate_target(job_id, attempt, step, world_size, deadline_s)
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        _fence(conn, job_id, attempt)
        row = _open(conn, job_id, attempt, step)
        if row is not None:
            row = _usable(row, world_size, ts, job_id, step)
        else:
            row = _create(conn, job_id, attempt, step, world_size, deadline_s, ts)
        return _record(row, _shard_rows(conn, row.id))


def report_shard(
    engine: Engine, job_id: str, attempt: int, step: int, world_size: int, shard: ShardRecord,
    deadline_s: float = 0.0, *, now: float | None = None,
) -> CheckpointRecord:
    """Record one rank's shard (beginning the checkpoint if none is open) and commit once all ranks reported."""
    _validate_target(job_id, attempt, step, world_size, deadline_s)
    _validate_shard(shard, world_size)
    ts = time.time() if now is None else now
    with engine.begin() as conn:
        _fence(conn, job_id, attempt)
        row = _open(conn, job_id, attempt, step)
        if row is None:
            row = _create(conn, job_id, attempt, step, world_size, deadline_s, ts)
        else:
            row = _usable(row, world_size, ts, job_id, step)
        existing = conn.execute(
            select(CheckpointShard).where(CheckpointShard.checkpoint_id == row.id, CheckpointShard.rank == shard.rank)
        ).first()
        if existing is not None:
            if (existing.uri, existing.checksum, existing.size_bytes) != (shard.uri, shard.checksum, shard.size_bytes):
                raise AlreadyExists(
                    f"checkpoint {row.id} of job {job_id[:80]!r} step {step} already has a different shard for rank "
                    f"{shard.rank} ({existing.uri}, {existing.checksum})"
                )
            return _record(row, _shard_rows(conn, row.id))  # the same report again: idempotent
        if row.state == COMMITTED:  # a committed checkpoint has every shard; unreachable unless world_size was 0
            raise FailedPrecondition(f"checkpoint {row.id} of job {job_id[:80]!r} step {step} is already committed")
        conn.execute(
            insert(CheckpointShard).values(
                checkpoint_id=row.id, rank=shard.rank, uri=shard.uri, size_bytes=shard.size_bytes,
                checksum=shard.checksum,
            )
        )
        shard_rows = _shard_rows(conn, row.id)
        if len(shard_rows) == row.world_size:
            conn.execute(
                update(Checkpoint).where(Checkpoint.id == row.id, Checkpoint.state == PENDING)
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
        row = conn.execute(select(CheckpointRequest).where(CheckpointRequest.job_id == job_id)).first()
        if row is None:
            conn.execute(insert(CheckpointRequest).values(job_id=job_id, reason=reason, requested_at=ts))
            return RequestRecord(True, reason, ts)
        return RequestRecord(True, row.reason, row.requested_at)


def get_request(engine: Engine, job_id: str, attempt: int) -> RequestRecord:
    """The outstanding request for the job's current attempt (a superseded attempt is refused), with the job's
    checkpoint interval policy."""
    if attempt < 0:
        raise InvalidArgument(f"attempt must be >= 0, got {attempt}")
    with engine.execution_options(readonly=True).begin() as conn:
        if not _possible_job_id(job_id):
            raise NotFound(f"job {job_id[:80]!r} not found")
        current = conn.scalar(select(Job.attempt).where(Job.id == job_id))
        if current is None:
            raise NotFound(f"job {job_id[:80]!r} not found")
        if attempt != current:
            raise FailedPrecondition(
                f"job {job_id[:80]!r} attempt {attempt} is superseded: the current attempt is {current}"
            )
        row = conn.execute(select(CheckpointRequest).where(CheckpointRequest.job_id == job_id)).first()
        policy = _policy(conn, job_id, current)
    if row is None:
        return RequestRecord(False, policy=policy)
    return RequestRecord(True, row.reason, row.requested_at, policy)


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
    nodes = conn.scalar(
        select(func.count(func.distinct(Allocation.node_id))).where(
            Allocation.job_id == job_id, Allocation.attempt == attempt, Allocation.released_at.is_(None)
        )
    ) or 0
    return cp.compute_policy(
        events=int(events), node_hours=float(seconds) / cp.HOUR_S, nodes=max(1, int(nodes)),
        job_durations=_durations(conn, job_id, cp.JOB_COST_SAMPLES),
        cluster_durations=cluster_durations,
    )


# Every rank polls the policy (GetCheckpointRequest): the cluster-wide figures, which scan node_events and nodes,
# are shared by all of them and kept this long per database.
CLUSTER_FIGURES_TTL_S = 30.0
_cluster_cache: dict[str, tuple[float, tuple[int, float, list[float]]]] = {}


def _cluster_figures(conn) -> tuple[int, float, list[float]]:
    """(FATAL node events, node-seconds alive, durations of the cluster's recent commits), cached briefly."""
    key = conn.engine.url.render_as_string(hide_password=True)
    now = time.monotonic()
    hit = _cluster_cache.get(key)
    if hit is not None and now < hit[0]:
        return hit[1]
    events = conn.scalar(select(func.count()).select_from(NodeEvent).where(NodeEvent.severity == FATAL)) or 0
    alive = Node.last_heartbeat - Node.registered_at
    seconds = conn.scalar(select(func.sum(case((alive > 0, alive), else_=0.0)))) or 0.0
    figures = (int(events), float(seconds), _durations(conn, None, cp.CLUSTER_COST_SAMPLES))
    _cluster_cache[key] = (now + CLUSTER_FIGURES_TTL_S, figures)
    return figures


COORDINATOR_ENDPOINT = "checkpoint-coordinator"


def advertise(engine: Engine, address: str, checkpoint_dir: str = "", *, name: str = COORDINATOR_ENDPOINT,
              now: float | None = None) -> None:
    """Record where this coordinator is reached (and the checkpoint directory it serves), for a scheduler started
    without --checkpoint-coordinator. The last one to start wins."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    values = dict(address=address, detail={"checkpoint_dir": checkpoint_dir}, updated_at=time.time() if now is None
                  else now)
    with engine.begin() as conn:
        dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(dialect_insert(ServiceEndpoint).values(name=name, **values)
                     .on_conflict_do_update(index_elements=["name"], set_=values))
