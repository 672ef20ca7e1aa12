"""The multi-rank checkpoint commit protocol against a real coordinator on 127.0.0.1, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from helpers.jobs import insert_job, set_attempt, set_world
from helpers.waits import eventually, holds
from sqlalchemy import func, select

from db.engine import make_engine
from db.models import Checkpoint, CheckpointRequest, CheckpointShard, Job
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from services.checkpoint_coordinator import serve, store

JOB = "job-ckpt-1"


def _insert_job(db_url: str, job_id: str = JOB, attempt: int = 0) -> None:
    # A gang of 2 (2 replicas x 1 GPU) in the ledger: the world size every checkpoint of it has.
    insert_job(db_url, job_id, attempt=attempt, replicas=2, gpus_per_replica=1)


def _shard(rank: int, step: int = 10, tag: str = "") -> pb.Shard:
    return pb.Shard(
        rank=rank,
        uri=f"file:///ckpt/{JOB}/{step}/rank-{rank}.pkl{tag}",
        size_bytes=10 + rank,
        checksum=f"sha256:{rank:064x}{tag}",
    )


def _report(rank: int, step: int = 10, world: int = 3, attempt: int = 0, **kw) -> pb.ReportShardRequest:
    fields = {"job_id": JOB, "attempt": attempt, "step": step, "world_size": world, "shard": _shard(rank, step)}
    fields.update(kw)
    return pb.ReportShardRequest(**fields)


def _rows(db_url: str) -> tuple[int, int, list[tuple[int, str]]]:
    engine = make_engine(db_url)
    with engine.execution_options(readonly=True).connect() as conn:
        out = (
            conn.scalar(select(func.count()).select_from(Checkpoint)),
            conn.scalar(select(func.count()).select_from(CheckpointShard)),
            [tuple(r) for r in conn.execute(select(Checkpoint.step, Checkpoint.state).order_by(Checkpoint.created_at))],
        )
    engine.dispose()
    return out


@pytest.fixture
async def server(db_url):
    _insert_job(db_url)
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0.1)
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)


async def _latest(stub):
    return await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


async def test_commits_only_when_every_rank_reported(stub, db_url):
    set_world(db_url, JOB, 3)
    first = await stub.ReportShard(_report(2))
    assert (first.state, first.world_size, [s.rank for s in first.shards]) == ("PENDING", 3, [2])
    assert first.committed_at == 0 and first.deadline_at > time.time()
    code, details = await _code(_latest(stub))
    assert code == grpc.StatusCode.NOT_FOUND and "no committed checkpoint" in details
    second = await stub.ReportShard(_report(0))
    assert second.id == first.id and second.state == "PENDING"
    with pytest.raises(grpc.aio.AioRpcError):
        await _latest(stub)
    last = await stub.ReportShard(_report(1))
    assert last.state == "COMMITTED" and last.committed_at > 0 and [s.rank for s in last.shards] == [0, 1, 2]
    latest = await _latest(stub)
    assert latest == last and latest.shards[1] == _shard(1)
    assert _rows(db_url) == (1, 3, [(10, "COMMITTED")])


async def test_concurrent_reports_commit_once(stub, db_url):
    world = 8
    set_world(db_url, JOB, world)
    results = await asyncio.gather(*(stub.ReportShard(_report(r, world=world)) for r in range(world)))
    assert len({r.id for r in results}) == 1
    assert sum(r.state == "COMMITTED" for r in results) >= 1
    assert (await _latest(stub)).world_size == world
    assert _rows(db_url) == (1, world, [(10, "COMMITTED")])


async def test_explicit_begin_is_idempotent_and_sets_the_deadline(stub, db_url):
    begun = await stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, step=5, world_size=2, deadline_s=30))
    assert begun.state == "PENDING" and begun.shards == [] and 29 < begun.deadline_at - begun.created_at <= 30
    again = await stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, step=5, world_size=0))  # the ledger's
    assert again.id == begun.id and again.world_size == 2
    # a world size the ledger does not have is refused, whether or not a checkpoint is open
    code, details = await _code(stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, step=5, world_size=4)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the ledger has 2 ranks" in details
    code, details = await _code(stub.ReportShard(_report(0, step=5, world=3)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "world_size 3 does not match" in details
    await stub.ReportShard(_report(0, step=5, world=2))
    done = await stub.ReportShard(_report(1, step=5, world=2))
    assert done.id == begun.id and done.state == "COMMITTED"
    assert _rows(db_url) == (1, 2, [(5, "COMMITTED")])


async def test_deadline_aborts_and_previous_checkpoint_stays_the_restore_point(stub, db_url):
    for r in range(2):
        await stub.ReportShard(_report(r, step=10, world=2))
    committed = await _latest(stub)
    # step 20: only rank 0 reports before a short deadline
    pending = await stub.ReportShard(_report(0, step=20, world=2, deadline_s=0.3))
    assert pending.state == "PENDING"
    await eventually(  # the sweeper (every 0.1 s) aborts it once its deadline passed
        lambda: holds(lambda: _rows(db_url)[2] == [(10, "COMMITTED"), (20, "ABORTED")]), what="step 20 aborted"
    )
    code, details = await _code(stub.ReportShard(_report(1, step=20, world=2)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "aborted" in details
    assert await _latest(stub) == committed
    assert _rows(db_url)[:2] == (2, 3)  # the late shard was not written


async def test_expired_but_not_yet_swept_is_refused(db_url):
    _insert_job(db_url)
    engine = make_engine(db_url)
    try:
        store.report_shard(engine, JOB, 0, 1, 2, store.ShardRecord(0, "u0", 1, "sha256:0"), 5.0, now=100.0)
        with pytest.raises(store.FailedPrecondition, match="deadline"):
            store.report_shard(engine, JOB, 0, 1, 2, store.ShardRecord(1, "u1", 1, "sha256:1"), now=106.0)
        assert store.abort_expired(engine, now=104.0) == 0
        assert store.abort_expired(engine, now=106.0) == 1
    finally:
        engine.dispose()
    assert _rows(db_url) == (1, 1, [(1, "ABORTED")])


async def test_missing_shard_is_never_restored(stub, db_url):
    set_world(db_url, JOB, 3)
    for r in (0, 1):  # rank 2 of 3 never reports
        await stub.ReportShard(_report(r, world=3))
    code, _ = await _code(_latest(stub))
    assert code == grpc.StatusCode.NOT_FOUND
    engine = make_engine(db_url)
    try:
        assert store.abort_expired(engine, now=time.time() + 10_000) == 1
    finally:
        engine.dispose()
    code, _ = await _code(_latest(stub))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_superseded_attempt_is_fenced(stub, db_url):
    set_attempt(db_url, JOB, 1)
    await stub.ReportShard(_report(0, world=2, attempt=1))  # attempt 1 opens step 10
    set_attempt(db_url, JOB, 2)  # the gang is relaunched
    before = _rows(db_url)
    for call in (
        stub.ReportShard(_report(1, world=2, attempt=1)),
        stub.ReportShard(_report(0, step=11, world=2, attempt=1)),
        stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, attempt=1, step=12, world_size=2)),
        stub.ReportShard(_report(0, world=2, attempt=3)),  # a future attempt is refused too
        stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=JOB, attempt=1)),
    ):
        code, details = await _code(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "superseded" in details and "current attempt is 2" in details
    assert _rows(db_url)[:2] == before[:2]  # no row written (the sweeper may already have aborted step 10)
    await eventually(  # the sweeper aborts attempt 1's pending checkpoint
        lambda: holds(lambda: _rows(db_url)[2] == [(10, "ABORTED")]), what="attempt 1's step 10 aborted"
    )
    # attempt 2 checkpoints the same step afresh
    for r in range(2):
        done = await stub.ReportShard(_report(r, world=2, attempt=2))
    assert done.state == "COMMITTED" and done.attempt == 2
    assert (await _latest(stub)).id == done.id


async def test_torn_down_attempt_is_fenced_before_the_relaunch(stub, db_url):
    """The scheduler requeued the gang (PENDING, same attempt number until its next launch): its ranks, still
    alive for a moment, can neither begin nor complete a checkpoint, and their open one is aborted."""
    set_attempt(db_url, JOB, 1)
    await stub.ReportShard(_report(0, world=2, attempt=1))
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(Job.__table__.update().where(Job.id == JOB).values(state="PENDING"))
    before = _rows(db_url)
    for call in (
        stub.ReportShard(_report(1, world=2, attempt=1)),
        stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, attempt=1, step=12, world_size=2)),
    ):
        code, details = await _code(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "has ended (the job is PENDING)" in details
    assert _rows(db_url)[:2] == before[:2]
    store.abort_expired(engine)  # (the fixture's sweeper may have done it already)
    assert _rows(db_url)[2] == [(10, "ABORTED")]
    engine.dispose()


async def test_double_report_idempotent_and_conflict_refused(stub, db_url):
    first = await stub.ReportShard(_report(0, world=2))
    again = await stub.ReportShard(_report(0, world=2))
    assert again.id == first.id and list(again.shards) == list(first.shards)
    conflicting = _report(0, world=2, shard=_shard(0, tag="-other"))
    code, details = await _code(stub.ReportShard(conflicting))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "different shard for rank 0" in details
    done = await stub.ReportShard(_report(1, world=2))
    assert done.state == "COMMITTED"
    # after the commit, the same report is still idempotent, a different one still refused
    assert (await stub.ReportShard(_report(1, world=2))) == done
    code, _ = await _code(stub.ReportShard(conflicting))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert _rows(db_url) == (1, 2, [(10, "COMMITTED")])


BAD_REPORTS = {
    "empty job_id": (_report(0, job_id=""), "job_id"),
    "negative attempt": (_report(0, attempt=-1), "attempt"),
    "negative step": (_report(0, step=-1), "step"),
    "negative world_size": (_report(0, world=-1), "world_size"),
    "world_size beyond the ledger's": (_report(0, world=3), "world_size 3 does not match"),
    "world_size below the ledger's": (_report(0, world=1), "world_size 1 does not match"),
    "rank out of range": (_report(3, world=3), "rank"),
    "rank beyond the ledger's world": (_report(2, world=0), "rank must be in 0..1"),
    "negative rank": (_report(0, shard=pb.Shard(rank=-1, uri="u", checksum="c")), "rank"),
    "no shard": (pb.ReportShardRequest(job_id=JOB, step=1, world_size=1), "shard is required"),
    "empty uri": (_report(0, shard=pb.Shard(rank=0, uri=" ", checksum="c")), "uri"),
    "no checksum": (_report(0, shard=pb.Shard(rank=0, uri="u")), "checksum"),
    "long checksum": (_report(0, shard=pb.Shard(rank=0, uri="u", checksum="x" * 500)), "checksum"),
    "negative size": (_report(0, shard=pb.Shard(rank=0, uri="u", checksum="c", size_bytes=-1)), "size_bytes"),
    "NUL in uri": (_report(0, shard=pb.Shard(rank=0, uri="a\x00b", checksum="c")), "NUL"),
    "negative deadline": (_report(0, deadline_s=-1), "deadline_s"),
    "NaN deadline": (_report(0, deadline_s=float("nan")), "deadline_s"),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
async def test_invalid_report_changes_nothing(stub, db_url, case):
    request, needle = BAD_REPORTS[case]
    code, details = await _code(stub.ReportShard(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    assert _rows(db_url) == (0, 0, [])


async def test_invalid_begin(stub, db_url):
    for req in (
        pb.BeginCheckpointRequest(job_id=JOB, step=1, world_size=-1),
        pb.BeginCheckpointRequest(job_id=JOB, step=1, world_size=1),  # the ledger has 2
        pb.BeginCheckpointRequest(job_id=JOB, step=-1, world_size=1),
        pb.BeginCheckpointRequest(job_id="", step=1, world_size=1),
    ):
        code, _ = await _code(stub.BeginCheckpoint(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert _rows(db_url) == (0, 0, [])


@pytest.mark.parametrize("job_id", ["nope", "x" * 5000, "a\x00b"])
async def test_unknown_job_not_found(stub, db_url, job_id):
    for call in (
        stub.ReportShard(_report(0, job_id=job_id)),
        stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=job_id, step=1, world_size=1)),
        stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=job_id)),
        stub.GetCheckpointRequest(pb.GetCheckpointRequestRequest(job_id=job_id)),
    ):
        code, details = await _code(call)
        assert code == grpc.StatusCode.NOT_FOUND and "not found" in details, details
    assert _rows(db_url) == (0, 0, [])


async def test_request_flag_cleared_by_the_next_commit(stub, db_url):
    get = pb.GetCheckpointRequestRequest(job_id=JOB, attempt=0)
    assert (await stub.GetCheckpointRequest(get)).requested is False
    asked = await stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="preemption"))
    assert asked.requested and asked.reason == "preemption"
    again = await stub.RequestCheckpoint(pb.RequestCheckpointRequest(job_id=JOB, reason="user"))
    assert (again.reason, again.requested_at) == ("preemption", asked.requested_at)  # the first one stands
    seen = await stub.GetCheckpointRequest(get)
    assert seen.requested and seen.reason == "preemption"
    await stub.ReportShard(_report(0, world=2))
    assert (await stub.GetCheckpointRequest(get)).requested  # not until the commit
    await stub.ReportShard(_report(1, world=2))
    assert (await stub.GetCheckpointRequest(get)).requested is False
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(CheckpointRequest)) == 0
    engine.dispose()


async def test_record_checkpoint_still_commits_whole(stub):
    shards = [_shard(r) for r in range(2)]
    rec = await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, step=3, shards=shards))
    assert (rec.state, rec.world_size) == ("COMMITTED", 2)
    assert await _latest(stub) == rec
