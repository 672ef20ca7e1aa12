"""The checkpoint coordinator against real gRPC servers on 127.0.0.1, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.jobs import set_attempt, set_world
from helpers.ports import reserved_port
from sqlalchemy import func, insert, select

from db.engine import make_engine
from db.models import Checkpoint, CheckpointShard, Job
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc, scheduler_pb2
from services.checkpoint_coordinator import serve

JOB = "job-ckpt-1"
SERVICE = "phalanx.v1.CheckpointCoordinator"


def _insert_job(db_url: str, job_id: str = JOB) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            insert(Job).values(
                id=job_id,
                name=job_id,
                state="RUNNING",
                replicas=2,
                gpus_per_replica=8,
                command=["train"],
                submitted_at=time.time(),
            )
        )
    engine.dispose()


def _counts(db_url: str) -> tuple[int, int]:
    engine = make_engine(db_url)
    with engine.execution_options(readonly=True).connect() as conn:
        counts = (
            conn.scalar(select(func.count()).select_from(Checkpoint)),
            conn.scalar(select(func.count()).select_from(CheckpointShard)),
        )
    engine.dispose()
    return counts


def _shards(n: int) -> list[pb.Shard]:
    return [
        pb.Shard(rank=r, uri=f"s3://ckpt/{r}.pt", size_bytes=100 + r, checksum=f"sha256:{r:064x}") for r in range(n)
    ]


@pytest.fixture
async def server(db_url):
    _insert_job(db_url)
    srv = await serve(db_url, "127.0.0.1:0")
    yield srv
    await srv.stop(0)


@pytest.fixture
async def channel(server):
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def stub(channel):
    return checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)


async def test_record_and_get_latest(stub, db_url):
    set_world(db_url, JOB, 4)
    first = await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=0, step=100, shards=_shards(4)))
    assert len(first.id) >= 8 and all(c in "0123456789abcdef" for c in first.id)
    assert (first.job_id, first.attempt, first.step, len(first.shards)) == (JOB, 0, 100, 4)
    assert first.committed_at > 0
    set_attempt(db_url, JOB, 1)  # relaunched as a gang of 2
    set_world(db_url, JOB, 2)
    # shards come back ordered by rank whatever order they were sent in
    second = await stub.RecordCheckpoint(
        pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=200, shards=list(reversed(_shards(2))))
    )
    assert [s.rank for s in second.shards] == [0, 1]
    await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=150, shards=_shards(2)))
    latest = await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))
    assert latest == second
    assert latest.shards[1] == pb.Shard(rank=1, uri="s3://ckpt/1.pt", size_bytes=101, checksum=f"sha256:{1:064x}")
    assert _counts(db_url) == (3, 8)


async def test_same_step_latest_commit_wins(stub, db_url):
    set_world(db_url, JOB, 1)
    await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, step=7, shards=_shards(1)))
    await asyncio.sleep(0.01)
    set_attempt(db_url, JOB, 1)
    later = await stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=JOB, attempt=1, step=7, shards=_shards(1)))
    assert (await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))).id == later.id


async def test_latest_not_found_without_checkpoints(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=JOB))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no committed checkpoint" in err.value.details()


@pytest.mark.parametrize("job_id", ["nope", "ジョブ-🚀", "x" * 5000, "a\x00b", "' OR 1=1 --", "%"])
async def test_unknown_job_not_found(stub, db_url, job_id):
    for call in (
        stub.GetLatestCheckpoint(pb.GetLatestCheckpointRequest(job_id=job_id)),
        stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=job_id, step=1, shards=_shards(2))),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert "not found" in err.value.details()
    assert _counts(db_url) == (0, 0)


def _bad(**overrides) -> pb.RecordCheckpointRequest:
    fields = {"job_id": JOB, "attempt": 0, "step": 1, "shards": _shards(3)}
    fields.update(overrides)
    return pb.RecordCheckpointRequest(**fields)


INVALID = {
    "empty job_id": (_bad(job_id=""), "job_id"),
    "negative step": (_bad(step=-1), "step"),
    "negative attempt": (_bad(attempt=-2), "attempt"),
    "no shards": (_bad(shards=[]), "shard"),
    "duplicate rank": (_bad(shards=[pb.Shard(rank=0, uri="a"), pb.Shard(rank=0, uri="b")]), "duplicate"),
    "negative rank": (_bad(shards=[pb.Shard(rank=-1, uri="a")]), "rank"),
    "negative size": (_bad(shards=[pb.Shard(rank=0, uri="a", size_bytes=-5)]), "size_bytes"),
    "empty uri": (_bad(shards=[pb.Shard(rank=0, uri="a"), pb.Shard(rank=1, uri="")]), "uri"),
    "rank gap": (_bad(shards=[pb.Shard(rank=0, uri="a"), pb.Shard(rank=2, uri="b")]), "0..1"),
    "ranks not from zero": (_bad(shards=[pb.Shard(rank=1, uri="a"), pb.Shard(rank=2, uri="b")]), "0..1"),
    "checksum too long": (_bad(shards=[pb.Shard(rank=0, uri="a", checksum="x" * 500)]), "checksum"),
}


@pytest.mark.parametrize("case", list(INVALID))
async def test_invalid_argument_changes_nothing(stub, db_url, case):
    request, needle = INVALID[case]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RecordCheckpoint(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert _counts(db_url) == (0, 0)


async def test_health_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name async for resp in call for s in resp.list_services_response.service]
    assert SERVICE in names and "grpc.health.v1.Health" in names


def _free_port() -> int:
    return reserved_port()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
def test_process_stops_cleanly_on_signal(sqlite_url, sig):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.checkpoint_coordinator.main",
            "--db",
            sqlite_url,
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.PIPE,
        env={**os.environ, "PHALANX_LOG_LEVEL": "INFO"},
    )
    try:
        deadline = time.time() + 20
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=max(1, deadline - time.time()))
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        assert b"checkpointd_stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_the_coordinator_advertises_itself_and_a_scheduler_without_flags_finds_it(db_url):
    """`phalanx-scheduler --db URL --listen ADDR` alone: ranks still get the coordinator and its directory, from
    the ledger; a scheduler flag wins over it."""
    from helpers.lite_cluster import LiteCluster
    from helpers.procs import eventually

    from phalanx.core.fabric import default_fabric
    from phalanx.testing.lite_agent import LiteAgent
    from services.scheduler.settings import SchedulerSettings

    coordinator = await serve(db_url, "127.0.0.1:0", checkpoint_dir="/shared/ckpt")
    try:
        for flags, want in (
            ({}, (coordinator.address, "/shared/ckpt")),
            ({"checkpoint_addr": "elsewhere:1", "checkpoint_dir": "/other"}, ("elsewhere:1", "/other")),
        ):
            settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["n0"]), **flags)
            async with LiteCluster(settings, lambda addr: [LiteAgent(addr, "n0")]) as c:
                job = await c.submit("train", 1, 8)
                await c.wait_running(job.id)
                launch = await eventually(lambda job=job: _launch_of(c.agents[0], job.id), what="launch")
                assert (launch.env["PHALANX_CHECKPOINT_ADDR"], launch.env["PHALANX_CHECKPOINT_DIR"]) == want
                await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
    finally:
        await coordinator.stop()


async def _launch_of(agent, job_id):
    return next((launch for launch in agent.launched if launch.job_id == job_id), None)
