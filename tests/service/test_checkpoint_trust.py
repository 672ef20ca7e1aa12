"""Checkpoints that no client can corrupt (issue 16), through the real coordinator on 127.0.0.1, on SQLite and
PostgreSQL: the world size and the attempt come from the ledger, a checkpoint commits only with one shard of each
rank 0..N-1, restores fall back over missing or damaged checkpoints and say so, and nothing is unpickled by
default."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
from pathlib import Path

import grpc
import pytest
from helpers.jobs import insert_job, set_attempt
from sqlalchemy import insert, select, update

from db.engine import make_engine
from db.models import Checkpoint, CheckpointRestore, CheckpointShard, Job
from phalanx import train
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.train import state_format
from services.checkpoint_coordinator import serve

JOB = "job-trust-1"
WORLD = 4


@pytest.fixture
async def server(db_url):
    insert_job(db_url, JOB, attempt=1, replicas=WORLD, gpus_per_replica=1)  # a gang of 4 ranks
    srv = await serve(db_url, "127.0.0.1:0", sweep_interval=0)
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)


def _shard(rank: int, step: int = 10, tag: str = "") -> pb.Shard:
    return pb.Shard(
        rank=rank,
        uri=f"file:///ckpt/{JOB}/{step}/rank-{rank}.json{tag}",
        size_bytes=10 + rank,
        checksum="sha256:" + hashlib.sha256(f"{step}/{rank}{tag}".encode()).hexdigest(),
    )


def _report(rank: int, step: int = 10, world: int = 0, attempt: int = 1, **kw) -> pb.ReportShardRequest:
    return pb.ReportShardRequest(
        job_id=JOB, attempt=attempt, step=step, world_size=world, shard=kw.pop("shard", _shard(rank, step)), **kw
    )


async def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


def _ledger(db_url: str) -> dict[str, list[tuple]]:
    """Every checkpoint row the coordinator writes, in a stable order."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return {
                "checkpoints": [
                    tuple(r)
                    for r in conn.execute(
                        select(
                            Checkpoint.id,
                            Checkpoint.attempt,
                            Checkpoint.step,
                            Checkpoint.state,
                            Checkpoint.world_size,
                            Checkpoint.committed_at,
                        ).order_by(Checkpoint.id)
                    )
                ],
                "shards": [
                    tuple(r)
                    for r in conn.execute(
                        select(
                            CheckpointShard.checkpoint_id,
                            CheckpointShard.rank,
                            CheckpointShard.uri,
                            CheckpointShard.checksum,
                        ).order_by(CheckpointShard.checkpoint_id, CheckpointShard.rank)
                    )
                ],
                "restores": [
                    tuple(r)
                    for r in conn.execute(
                        select(
                            CheckpointRestore.attempt,
                            CheckpointRestore.rank,
                            CheckpointRestore.checkpoint_id,
                            CheckpointRestore.message,
                        ).order_by(CheckpointRestore.attempt, CheckpointRestore.rank)
                    )
                ],
            }
    finally:
        engine.dispose()


async def _commit(stub, step: int, attempt: int = 1) -> pb.Checkpoint:
    for r in range(WORLD):
        done = await stub.ReportShard(_report(r, step, attempt=attempt))
    assert done.state == "COMMITTED"
    return done


async def _listed(stub) -> list[tuple[int, int]]:
    page = await stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB))
    return [(c.step, c.attempt) for c in page.checkpoints]


# -- the coordinator trusts no client number ---------------------------------------------------------------------


async def test_a_single_shard_claiming_world_size_1_of_a_4_rank_gang_is_refused(stub, db_url):
    code, details = await _code(stub.ReportShard(_report(0, world=1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "the ledger has 4 ranks" in details, details
    code, details = await _code(
        stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, attempt=1, step=10, world_size=1))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "world_size 1 does not match" in details
    code, details = await _code(
        stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=10, shards=[_shard(0)]))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "has 4 ranks" in details and "got 1 shards" in details
    assert _ledger(db_url) == {"checkpoints": [], "shards": [], "restores": []}
    code, _ = await _code(stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert await _listed(stub) == []
    # world_size 0 means the ledger's: the same shard opens a checkpoint that needs all four
    opened = await stub.ReportShard(_report(0, world=0))
    assert (opened.state, opened.world_size) == ("PENDING", WORLD)


@pytest.mark.slow
async def test_the_world_size_is_the_attempts_ranks_in_the_ledger(db_url):
    """With the real scheduler: a gang of 2 replicas x 2 GPUs has 4 ranks (its allocations), one of 2 replicas x 2
    GPUs at one process per replica has 2."""
    from helpers.lite_cluster import LiteCluster

    from phalanx.core.fabric import default_fabric
    from phalanx.testing.lite_agent import LiteAgent
    from services.scheduler.settings import SchedulerSettings

    coordinator = await serve(db_url, "127.0.0.1:0", sweep_interval=0)
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["n0"]))
    try:
        async with (
            LiteCluster(settings, lambda addr: [LiteAgent(addr, "n0", gpus=8)]) as c,
            grpc.aio.insecure_channel(coordinator.address) as ch,
        ):
            stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(ch)
            per_gpu = await c.submit("per-gpu", 2, 2)
            per_replica = await c.submit("per-replica", 2, 2, procs_per_replica=1)
            for job, world in ((per_gpu, 4), (per_replica, 2)):
                running = await c.wait_running(job.id)
                req = pb.ReportShardRequest(
                    job_id=job.id, attempt=running.attempt, step=1, world_size=1, shard=_shard(0, 1)
                )
                code, details = await _code(stub.ReportShard(req))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and f"the ledger has {world} ranks" in details
                req.world_size = 0
                for rank in range(world):
                    req.shard.CopyFrom(_shard(rank, 1))
                    done = await stub.ReportShard(req)
                assert (done.state, done.world_size, len(done.shards)) == ("COMMITTED", world, world)
            # `phalanx job` (GetJob) shows what the current attempt restored from, once its ranks reported it
            assert (await c.job(per_gpu.id)).restore == ""
            attempt = (await c.job(per_gpu.id)).attempt
            latest = await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=per_gpu.id))
            for rank in range(4):
                await stub.ReportRestore(
                    pb.ReportRestoreRequest(job_id=per_gpu.id, attempt=attempt, rank=rank, checkpoint_id=latest.id)
                )
            shown = await c.job(per_gpu.id)
            assert shown.restore == (await stub.GetRestore(pb.GetRestoreRequest(job_id=per_gpu.id))).message
            assert shown.restore.startswith("restored from step 1")
            assert (await c.job(per_replica.id)).restore == ""
    finally:
        await coordinator.stop(0)


async def test_every_write_of_another_attempt_is_refused_and_changes_nothing(stub, db_url):
    set_attempt(db_url, JOB, 2)
    committed = await _commit(stub, 5, attempt=2)
    await stub.ReportShard(_report(0, 8, attempt=2))  # attempt 2 has step 8 open, one shard in
    before = _ledger(db_url)
    for attempt in (1, 3):  # superseded, and one that does not exist yet
        for call in (
            stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=JOB, attempt=attempt, step=9)),
            stub.ReportShard(_report(1, 8, attempt=attempt)),
            stub.ReportShard(_report(0, 12, attempt=attempt)),
            stub.RecordCheckpoint(
                pb.RecordCheckpointRequest(
                    job_id=JOB, attempt=attempt, step=100, shards=[_shard(r, 100) for r in range(WORLD)]
                )
            ),
            stub.ReportRestore(
                pb.ReportRestoreRequest(job_id=JOB, attempt=attempt, rank=0, checkpoint_id=committed.id)
            ),
        ):
            code, details = await _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, details
            assert f"attempt {attempt} is superseded: the current attempt is 2" in details
    assert _ledger(db_url) == before
    assert (await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))).id == committed.id
    assert await _listed(stub) == [(5, 2)]
    # the scheduler tore attempt 2 down: its own writes are refused too
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(Job).where(Job.id == JOB).values(state="PENDING"))
    engine.dispose()
    code, details = await _code(
        stub.RecordCheckpoint(
            pb.RecordCheckpointRequest(job_id=JOB, attempt=2, step=100, shards=[_shard(r, 100) for r in range(WORLD)])
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "has ended" in details
    assert _ledger(db_url) == before


async def test_a_rank_reports_one_shard_per_checkpoint(stub, db_url):
    first = await stub.ReportShard(_report(1))
    again = await stub.ReportShard(_report(1))  # the same shard again: a no-op
    assert again == first and [s.rank for s in again.shards] == [1]
    other = _report(1, shard=_shard(1, tag="-forged"))
    code, details = await _code(stub.ReportShard(other))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "different shard for rank 1" in details
    for r in (0, 2, 3):
        done = await stub.ReportShard(_report(r))
    assert done.state == "COMMITTED" and [s.checksum for s in done.shards] == [_shard(r).checksum for r in range(4)]
    before = _ledger(db_url)
    assert await stub.ReportShard(_report(3)) == done  # still a no-op after the commit
    code, _ = await _code(stub.ReportShard(other))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert _ledger(db_url) == before


async def test_a_checkpoint_commits_only_with_ranks_0_to_n_minus_1(stub, db_url):
    for r in (0, 1, 2):
        pending = await stub.ReportShard(_report(r))
    assert pending.state == "PENDING"
    code, details = await _code(stub.ReportShard(_report(4)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "rank must be in 0..3" in details
    code, _ = await _code(stub.ReportShard(_report(-1, shard=pb.Shard(rank=-1, uri="u", checksum="sha256:x"))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.ReportShard(_report(2))).state == "PENDING"
    assert await _listed(stub) == []
    done = await stub.ReportShard(_report(3))
    assert done.state == "COMMITTED" and [s.rank for s in done.shards] == [0, 1, 2, 3]
    # RecordCheckpoint: exactly ranks 0..3
    for ranks, needle in (((0, 1, 2, 3, 4), "got 5 shards"), ((0, 1, 2, 4), "missing [3]"), ((0, 1, 2), "got 3")):
        before = _ledger(db_url)
        code, details = await _code(
            stub.RecordCheckpoint(
                pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=20, shards=[_shard(r, 20) for r in ranks])
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
        assert _ledger(db_url) == before
    whole = await stub.RecordCheckpoint(
        pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=20, shards=[_shard(r, 20) for r in range(WORLD)])
    )
    assert (whole.state, whole.world_size) == ("COMMITTED", WORLD)
    assert await _listed(stub) == [(20, 1), (10, 1)]


async def test_an_incomplete_or_unfenced_commit_is_never_a_restore_point(stub, db_url):
    """Rows written around the API (an older coordinator, a hand edit) that no restore may use: a COMMITTED
    checkpoint missing a shard, and one of an attempt later than the job's."""
    good = await _commit(stub, 10)
    engine = make_engine(db_url)
    with engine.begin() as conn:
        for cid, attempt, step, ranks in (("torn", 1, 50, (0, 1, 3)), ("future", 7, 60, (0, 1, 2, 3))):
            conn.execute(
                insert(Checkpoint).values(
                    id=cid,
                    job_id=JOB,
                    attempt=attempt,
                    step=step,
                    state="COMMITTED",
                    created_at=1.0,
                    committed_at=1.0,
                    world_size=WORLD,
                    message="",
                )
            )
            conn.execute(
                insert(CheckpointShard),
                [dict(checkpoint_id=cid, rank=r, uri=f"u{r}", size_bytes=1, checksum="sha256:0") for r in ranks],
            )
    engine.dispose()
    assert (await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))).id == good.id
    assert await _listed(stub) == [(10, 1)]


async def test_list_checkpoints_pages_newest_first(stub):
    for step in (3, 9, 6):
        await _commit(stub, step)
    first = await stub.ListCheckpoints(pb.ListCheckpointsRequest(job_id=JOB, page_size=2))
    assert [c.step for c in first.checkpoints] == [9, 6] and first.next_page_token
    assert all(len(c.shards) == WORLD for c in first.checkpoints)
    rest = await stub.ListCheckpoints(
        pb.ListCheckpointsRequest(job_id=JOB, page_size=2, page_token=first.next_page_token)
    )
    assert [c.step for c in rest.checkpoints] == [3] and rest.next_page_token == ""
    for req, code in (
        (pb.ListCheckpointsRequest(job_id=JOB, page_token="x"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ListCheckpointsRequest(job_id=JOB, page_size=-1), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ListCheckpointsRequest(job_id=JOB, page_size=5000), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ListCheckpointsRequest(job_id="nope"), grpc.StatusCode.NOT_FOUND),
    ):
        assert (await _code(stub.ListCheckpoints(req)))[0] == code


async def test_a_restore_report_is_checked_against_the_ledger(stub, db_url):
    old, new = await _commit(stub, 5), await _commit(stub, 9)

    def report(checkpoint_id: str, *skipped: str, rank: int = 0) -> pb.ReportRestoreRequest:
        return pb.ReportRestoreRequest(
            job_id=JOB,
            attempt=1,
            rank=rank,
            checkpoint_id=checkpoint_id,
            skipped=[pb.SkippedCheckpoint(checkpoint_id=s, reason="damaged") for s in skipped],
        )

    for req, needle in (
        (report("nope"), "not the newest"),
        (report(old.id), "not the newest"),  # leaves the intact step 9 out
        (report(""), "neither restores nor skips"),  # starts from 0 with checkpoints left
        (report(new.id, old.id), "is not one of the 1 newest"),  # skips an older one
        (report(old.id, "nope"), "is not one of the 1 newest"),
        (report(new.id, rank=WORLD), "rank must be in 0..3"),
        (
            pb.ReportRestoreRequest(
                job_id=JOB, attempt=1, checkpoint_id=old.id, skipped=[pb.SkippedCheckpoint(checkpoint_id=new.id)]
            ),
            "reason is required",
        ),
    ):
        code, details = await _code(stub.ReportRestore(req))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (needle, details)
    code, details = await _code(stub.GetRestore(pb.GetRestoreRequest(job_id=JOB)))
    assert code == grpc.StatusCode.NOT_FOUND and "no restore report" in details
    assert _ledger(db_url)["restores"] == []
    got = await stub.ReportRestore(report(old.id, new.id, rank=3))
    assert (got.step, got.fell_back_from, got.message) == (5, 9, "restored from step 5 (step 9 was damaged: damaged)")
    assert [s.step for s in got.skipped] == [9]  # from the ledger


# -- restore falls back ------------------------------------------------------------------------------------------


def _ranks(server, tmp_path: Path, attempt: int = 1) -> list[train.Checkpointer]:
    return [
        train.Checkpointer(
            {
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "PHALANX_JOB_ID": JOB,
                "PHALANX_ATTEMPT": str(attempt),
                "PHALANX_CHECKPOINT_ADDR": server.address,
                "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            }
        )
        for r in range(WORLD)
    ]


async def _save_all(ranks, step: int) -> list[train.SaveResult]:
    return [
        await asyncio.to_thread(c.save, step, {"step": step, "rank": c.rank, "w": [step * 0.5, c.rank]}) for c in ranks
    ]


async def _restore_all(ranks, **kw):
    return [await asyncio.to_thread(c.restore, **kw) for c in ranks]


def _path(result: train.SaveResult) -> Path:
    return Path(result.uri.removeprefix("file://"))


async def _gang_with_two_checkpoints(server, tmp_path, db_url):
    ranks = _ranks(server, tmp_path)
    await _save_all(ranks, 5)
    newest = await _save_all(ranks, 9)
    set_attempt(db_url, JOB, 2)  # the gang is relaunched and restores
    for c in ranks:
        c.close()
    return _ranks(server, tmp_path, attempt=2), newest


def _intact(step: int, rank: int) -> tuple[int, dict]:
    return step, {"step": step, "rank": rank, "w": [step * 0.5, rank]}


async def test_restore_skips_a_damaged_newest_checkpoint_and_says_so(server, stub, tmp_path, db_url, caplog):
    ranks, newest = await _gang_with_two_checkpoints(server, tmp_path, db_url)
    path = _path(newest[2])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit in rank 2's shard of step 9
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="phalanx.train"):
        assert await _restore_all(ranks) == [_intact(5, r) for r in range(WORLD)]
    want = "restored from step 5 (step 9 was damaged: sha256 mismatch in rank 2's shard)"
    assert all(c.last_restore.message == want and c.last_restore.fell_back for c in ranks)
    skipped = [r for r in caplog.records if r.getMessage().startswith("checkpoint_restore_skipped")]
    assert len(skipped) == WORLD and all(r.levelno == logging.WARNING for r in skipped)
    assert skipped[0].checkpoint["step"] == 9 and skipped[0].checkpoint["reason"] == "sha256 mismatch in rank 2's shard"
    state = await stub.GetRestore(pb.GetRestoreRequest(job_id=JOB))
    assert (state.attempt, state.step, state.fell_back_from, state.consistent) == (2, 5, 9, True)
    assert state.message == want and [r.rank for r in state.ranks] == [0, 1, 2, 3]
    assert (await stub.GetRestore(pb.GetRestoreRequest(job_id=JOB, attempt=2))).message == want
    code, _ = await _code(stub.GetRestore(pb.GetRestoreRequest(job_id=JOB, attempt=1)))
    assert code == grpc.StatusCode.NOT_FOUND
    for c in ranks:
        c.close()


async def test_restore_skips_a_missing_shard(server, stub, tmp_path, db_url):
    ranks, newest = await _gang_with_two_checkpoints(server, tmp_path, db_url)
    _path(newest[1]).unlink()
    assert await _restore_all(ranks) == [_intact(5, r) for r in range(WORLD)]
    state = await stub.GetRestore(pb.GetRestoreRequest(job_id=JOB))
    assert state.message == f"restored from step 5 (step 9 was damaged: rank 1's shard is missing ({newest[1].uri}))"
    # a truncated shard is a size mismatch
    path = _path((await _save_all(ranks, 12))[3])
    path.write_bytes(path.read_bytes()[:-3])
    assert (await asyncio.to_thread(ranks[0].restore))[0] == 5
    assert ranks[0].last_restore.message.startswith(
        "restored from step 5 (step 12 was damaged: size mismatch in rank 3's shard: expected "
    )
    assert [s.step for s in ranks[0].last_restore.skipped] == [12, 9]
    for c in ranks:
        c.close()


async def test_restore_starts_from_zero_when_no_checkpoint_is_intact(server, stub, tmp_path, db_url):
    ranks, newest = await _gang_with_two_checkpoints(server, tmp_path, db_url)
    _path(newest[0]).write_bytes(b"garbage")
    old = tmp_path / "ckpt" / JOB / "5" / "attempt-1" / "rank-3.json"
    old.write_bytes(old.read_bytes().replace(b'"rank":3', b'"rank":0'))
    assert await _restore_all(ranks) == [None] * WORLD
    want = (
        "started from step 0: no intact checkpoint (step 9 was damaged: size mismatch in rank 0's shard: "
        f"expected {newest[0].size_bytes} bytes, found 7; step 5 was damaged: sha256 mismatch in rank 3's shard)"
    )
    state = await stub.GetRestore(pb.GetRestoreRequest(job_id=JOB))
    assert (state.step, state.fell_back_from, state.message, state.consistent) == (-1, 9, want, True)
    assert ranks[2].last_restore == train.RestoreResult(-1, "", ranks[2].last_restore.skipped, want)
    for c in ranks:
        c.close()


async def test_a_job_without_checkpoints_reports_a_fresh_start(server, stub, tmp_path):
    ranks = _ranks(server, tmp_path)
    assert await _restore_all(ranks) == [None] * WORLD
    state = await stub.GetRestore(pb.GetRestoreRequest(job_id=JOB))
    assert (state.step, state.fell_back_from, state.message) == (-1, -1, "started from step 0: no checkpoint")
    for c in ranks:
        c.close()


# -- no pickle from storage by default ---------------------------------------------------------------------------


async def _legacy_pickle_checkpoint(stub, tmp_path: Path, step: int, payload_of) -> None:
    """A checkpoint as phalanx.train before issue 16 wrote it: one pickle per rank (`rank-<r>.pkl`)."""
    store = train.LocalStore(tmp_path / "ckpt")
    for rank in range(WORLD):
        path = store.path(JOB, 1, step, rank, suffix=".pkl")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = pickle.dumps(payload_of(rank), protocol=pickle.HIGHEST_PROTOCOL)
        path.write_bytes(data)
        await stub.ReportShard(
            _report(
                rank,
                step,
                shard=pb.Shard(
                    rank=rank, uri=path.as_uri(), size_bytes=len(data), checksum=train.sha256_checksum(data)
                ),
            )
        )


class _Mkdir:
    """Unpickling this runs os.mkdir: what any pickle from storage could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


async def test_a_pickle_is_refused_unless_allowed(server, stub, tmp_path):
    await _legacy_pickle_checkpoint(stub, tmp_path, 4, lambda rank: {"count": 4, "rank": rank})
    ranks = _ranks(server, tmp_path)
    with pytest.raises(train.CheckpointPickleError, match=r"restore\(allow_pickle=True\)") as err:
        await asyncio.to_thread(ranks[0].restore)
    assert "is a pickle" in str(err.value) and "arbitrary code" in str(err.value)
    assert await _restore_all(ranks, allow_pickle=True) == [(4, {"count": 4, "rank": r}) for r in range(WORLD)]
    # the next save is JSON, and restores without allow_pickle
    results = await _save_all(ranks, 8)
    assert all(state_format.is_state(_path(r).read_bytes()) and r.uri.endswith(".json") for r in results)
    assert await _restore_all(ranks) == [_intact(8, r) for r in range(WORLD)]
    for c in ranks:
        c.close()


async def test_a_refused_pickle_is_never_unpickled(server, stub, tmp_path):
    marker = tmp_path / "unpickled"
    await _legacy_pickle_checkpoint(stub, tmp_path, 4, lambda rank: {"x": _Mkdir(str(marker))})
    with _ranks(server, tmp_path)[0] as c:
        with pytest.raises(train.CheckpointPickleError):
            await asyncio.to_thread(c.restore)
    assert not marker.exists()


# -- the JSON format ---------------------------------------------------------------------------------------------


def test_state_format_round_trips_what_json_cannot_say():
    import numpy as np

    state = {
        "a": 1,
        "f": [1.5, float("inf"), float("-inf")],
        "t": (1, "x", None),
        3: b"\x00\xff",
        "$phx:tuple": "a user key that looks like a tag",
        "nested": {"k": [True, {"deep": 2**70}]},
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": np.float32(2.5),
    }
    data = state_format.encode(state)
    assert state_format.is_state(data) and b"\n" in data
    back = state_format.decode(data)
    arr, scalar = back.pop("arr"), back.pop("scalar")
    assert back == {k: v for k, v in state.items() if k not in ("arr", "scalar")}
    assert arr.dtype == np.int16 and arr.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert isinstance(scalar, np.float32) and scalar == 2.5
    nan = state_format.decode(state_format.encode(float("nan")))
    assert nan != nan
    plain = state_format.encode({"count": 3})
    assert plain == b'{"format":"phalanx.train/state-v1","blobs":0,"state":{"count":3}}\n'


def test_state_format_refuses_what_it_cannot_hold_and_bad_shards():
    with pytest.raises(train.CheckpointError, match=r"state\['opt'\]\[1\]: a builtins.object"):
        state_format.encode({"opt": [1, object()]})
    loop: list = []
    loop.append(loop)
    with pytest.raises(train.CheckpointError, match="contains itself"):
        state_format.encode(loop)
    for bad in (
        b"\x80\x05K\x01.",  # a pickle
        b'{"format":"phalanx.train/state-v1","blobs":4,"state":1}\n',  # says 4 bytes follow, none do
        b'{"format":"phalanx.train/state-v1","blobs":0,"state":{"$phx:ndarray":{"dtype":"O","shape":[1],'
        b'"offset":0,"nbytes":0}}}\n',
        b'{"format":"phalanx.train/state-v1","blobs":0,"state":{"$phx:eval":"1"}}\n',
    ):
        with pytest.raises(train.CheckpointError):
            state_format.decode(bad)
