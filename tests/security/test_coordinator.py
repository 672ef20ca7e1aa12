"""The checkpoint coordinator against its callers. A real scheduler and a real coordinator on one ledger (SQLite and
PostgreSQL), both with a tokens file, the coordinator owning a storage root (--checkpoint-root).

Threats (who, what they control, what they must not reach):

1. A rank of bob's job (its PHALANX_JOB_TOKEN, and everything in the requests it sends) writes shards into alice's
   job's checkpoint, or records a whole checkpoint for it: PERMISSION_DENIED, nothing written.
2. Bob himself (a user token) begins, reports or commits a checkpoint of alice's job: NOT_FOUND (her job is hidden
   from him), nothing written.
3. A rank names its shard with a path that leaves its job's prefix <root>/<tenant>/<job>/ (`..`, an absolute path,
   another tenant's prefix, another scheme): INVALID_ARGUMENT, nothing written; its own prefix commits.
4. A node agent's token writes checkpoints: PERMISSION_DENIED.

Each method of the coordinator against each kind of caller is in tests/service/test_coordinator_auth.py; a write of
another (ended) attempt of the same job in tests/service/test_checkpoint_trust.py
(test_every_write_of_another_attempt_is_refused_and_changes_nothing).
"""

from __future__ import annotations

import grpc
import pytest
from helpers.tokens import write_tokens
from sqlalchemy import create_engine, text

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.client import AsyncClient
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator.main import serve as serve_coordinator
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

ENTRIES = [
    ("tok-alice", "alice", "user", ""),
    ("tok-bob", "bob", "user", ""),
    ("tok-node", "nodes", "node", "node-0"),
]
SUM = "sha256:" + "0" * 64


class Setup:
    def __init__(self, coordinator, root, alice_job: str, bob_job: str, key: str, db_url: str) -> None:
        self.coordinator, self.root, self.alice_job, self.bob_job = coordinator, root, alice_job, bob_job
        self.key, self.db_url = key, db_url
        self.channels: list[grpc.aio.Channel] = []

    def stub(self, token: str) -> checkpoint_pb2_grpc.CheckpointCoordinatorStub:
        channel = open_aio_channel(self.coordinator.address, token=token)
        self.channels.append(channel)
        return checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)

    def own_uri(self, name: str = "rank-0.json") -> str:
        return (self.root / "alice" / self.alice_job / "1" / "attempt-1" / name).as_uri()

    def written(self) -> tuple:
        engine = create_engine(self.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            got = tuple(
                conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar()
                for t in ("checkpoints", "checkpoint_shards", "checkpoint_step_reports")
            )
        engine.dispose()
        return got


@pytest.fixture
async def setup(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    root = tmp_path / "ckpt"
    root.mkdir()
    store = TokenStore(tokens)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"]), checkpoint_dir=str(root)
        ),
        tokens=store,
    )
    coordinator = await serve_coordinator(
        db_url, "127.0.0.1:0", tokens=store, sweep_interval=0, checkpoint_dir=str(root)
    )
    agent = LiteAgent(scheduler.address, "node-0", token="tok-node")
    await agent.start()
    alice = AsyncClient(scheduler.address, token="tok-alice", retries=0)
    bob = AsyncClient(scheduler.address, token="tok-bob", retries=0)
    s = None
    try:
        mine = await alice.wait((await alice.submit("a", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        theirs = await bob.wait((await bob.submit("b", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        engine = make_engine(db_url)
        with engine.begin() as conn:
            key = ensure_rank_key(conn)
        engine.dispose()
        s = Setup(coordinator, root, mine.id, theirs.id, key, db_url)
        yield s
    finally:
        for channel in s.channels if s else []:
            await channel.close()
        await alice.close()
        await bob.close()
        await agent.stop()
        await coordinator.stop(0)
        await scheduler.stop()


async def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def _writes(stub, job: str, uri: str) -> list:
    shard = pb.Shard(rank=0, uri=uri, size_bytes=1, checksum=SUM)
    return [
        stub.BeginCheckpoint(pb.BeginCheckpointRequest(job_id=job, attempt=1, step=5)),
        stub.ReportShard(pb.ReportShardRequest(job_id=job, attempt=1, step=5, shard=shard)),
        stub.RecordCheckpoint(pb.RecordCheckpointRequest(job_id=job, attempt=1, step=5, shards=[shard])),
        stub.ReportRestore(pb.ReportRestoreRequest(job_id=job, attempt=1, rank=0)),
    ]


async def test_1_a_rank_of_another_job_cannot_write_this_jobs_checkpoints(setup):
    before = setup.written()
    bobs_rank = setup.stub(rank_token(setup.key, setup.bob_job, 1))
    for call in _writes(bobs_rank, setup.alice_job, setup.own_uri()):
        assert await _refused(call) is grpc.StatusCode.PERMISSION_DENIED
    assert setup.written() == before


async def test_2_a_tenant_cannot_commit_for_another_tenants_job(setup):
    before = setup.written()
    bob = setup.stub("tok-bob")
    for call in _writes(bob, setup.alice_job, setup.own_uri()):
        assert await _refused(call) is grpc.StatusCode.NOT_FOUND
    assert setup.written() == before


async def test_3_a_shard_path_outside_the_jobs_prefix_is_refused(setup):
    rank = setup.stub(rank_token(setup.key, setup.alice_job, 1))
    root, job = setup.root, setup.alice_job
    before = setup.written()
    for uri in (
        f"file://{root}/alice/{job}/../{setup.bob_job}/1/attempt-1/rank-0.json",  # into another job
        f"file://{root}/alice/{job}/1/attempt-1/../../../../bob/x",  # up into another tenant
        f"file://{root}/alice/{job}/%2e%2e/x",  # an encoded `..`
        (root / "bob" / setup.bob_job / "x").as_uri(),  # another tenant's prefix, plainly
        "file:///etc/passwd",
        "s3://bucket/x",
    ):
        shard = pb.Shard(rank=0, uri=uri, size_bytes=1, checksum=SUM)
        code = await _refused(rank.ReportShard(pb.ReportShardRequest(job_id=job, attempt=1, step=1, shard=shard)))
        assert code is grpc.StatusCode.INVALID_ARGUMENT, uri
    assert setup.written() == before
    shard = pb.Shard(rank=0, uri=setup.own_uri(), size_bytes=1, checksum=SUM)
    done = await rank.ReportShard(pb.ReportShardRequest(job_id=job, attempt=1, step=1, shard=shard))
    assert done.state == "COMMITTED"


async def test_4_a_node_token_cannot_write_checkpoints(setup):
    before = setup.written()
    node = setup.stub("tok-node")
    for call in _writes(node, setup.alice_job, setup.own_uri()):
        assert await _refused(call) is grpc.StatusCode.PERMISSION_DENIED
    assert setup.written() == before
