"""The checkpoint coordinator authorizes every call (issue 20, items 1 and 2): a real scheduler and a real
coordinator on one ledger (SQLite and PostgreSQL), both with a tokens file, and every RPC of the coordinator against
every kind of caller, each with the status it must get; a refusal changes nothing.

Callers: no credential; a user of the owning tenant and one of another; the rank credential of the job's running
attempt (PHALANX_JOB_TOKEN, as the scheduler sends it with the launch), of another job, and of an ended attempt; a
node token; an admin.
"""

from __future__ import annotations

import grpc
import pytest
import structlog.testing
from helpers.tokens import write_tokens
from sqlalchemy import create_engine, text

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.client import AsyncClient
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, rank_token, verify_rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator.main import serve as serve_coordinator
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

OK, DENIED, HIDDEN, NOBODY = "ok", grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND, None
ENTRIES = [
    ("tok-alice", "alice", "user", ""),
    ("tok-bob", "bob", "user", ""),
    ("tok-admin", "ops", "admin", ""),
    ("tok-node", "nodes", "node", "node-0"),
]


def _shard(rank: int = 0) -> pb.Shard:
    return pb.Shard(rank=rank, uri=f"s3://ckpt/{rank}.pt", size_bytes=10, checksum=f"sha256:{rank:064x}")


def calls(job: str) -> dict[str, tuple[str, object]]:
    """Every RPC of the coordinator, on `job` (attempt 1), as (method, request)."""
    return {
        "RecordCheckpoint": (
            "RecordCheckpoint",
            pb.RecordCheckpointRequest(job_id=job, attempt=1, step=7, shards=[_shard()]),
        ),
        "BeginCheckpoint": ("BeginCheckpoint", pb.BeginCheckpointRequest(job_id=job, attempt=1, step=9)),
        "ReportShard": ("ReportShard", pb.ReportShardRequest(job_id=job, attempt=1, step=11, shard=_shard())),
        "RequestCheckpoint": ("RequestCheckpoint", pb.RequestCheckpointRequest(job_id=job, reason="user")),
        "GetCheckpointRequest": ("GetCheckpointRequest", pb.GetCheckpointRequestRequest(job_id=job, attempt=1)),
        "GetCheckpointPolicy": ("GetCheckpointPolicy", pb.GetCheckpointPolicyRequest(job_id=job)),
        "GetLatestCheckpoint": ("GetLatestCheckpoint", pb.GetLatestCheckpointRequest(job_id=job)),
        "ListCheckpoints": ("ListCheckpoints", pb.ListCheckpointsRequest(job_id=job)),
        "ReportRestore": ("ReportRestore", pb.ReportRestoreRequest(job_id=job, attempt=1, rank=0)),
        "GetRestore": ("GetRestore", pb.GetRestoreRequest(job_id=job)),
    }


# What each caller gets on every RPC of alice's running job (OK: not refused for who it is).
EXPECTED = {
    "none": grpc.StatusCode.UNAUTHENTICATED,
    "alice": OK,
    "bob": HIDDEN,
    "rank": OK,
    "rank_other_job": DENIED,
    "rank_ended": DENIED,
    "rank_forged": grpc.StatusCode.UNAUTHENTICATED,
    "node": DENIED,
    "admin": OK,
}


async def _code(stub, method: str, request) -> object:
    try:
        await getattr(stub, method)(request, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return OK, ""


def _snapshot(db_url: str) -> tuple:
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        got = tuple(
            conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
            for t in ("checkpoints", "checkpoint_shards", "checkpoint_requests", "checkpoint_restores")
        )
    engine.dispose()
    return got


async def test_every_coordinator_rpc_against_every_caller(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    store = TokenStore(tokens)
    scheduler = await serve(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"])), tokens=store
    )
    coordinator = await serve_coordinator(db_url, "127.0.0.1:0", tokens=store, sweep_interval=0)
    agent = LiteAgent(scheduler.address, "node-0", token="tok-node")
    await agent.start()
    alice = AsyncClient(scheduler.address, token="tok-alice", retries=0)
    bob = AsyncClient(scheduler.address, token="tok-bob", retries=0)
    channels = []
    try:
        job = await alice.wait((await alice.submit("a", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        other = await bob.wait((await bob.submit("b", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        ended = await alice.wait((await alice.submit("c", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        await alice.cancel(ended.id)
        # The launch carried the attempt's credential; it verifies under the ledger's key.
        engine = make_engine(db_url)
        with engine.begin() as conn:
            key = ensure_rank_key(conn)
        engine.dispose()
        launch = next(launch for launch in agent.launched if launch.job_id == job.id)
        credential = launch.env["PHALANX_JOB_TOKEN"]
        assert credential == rank_token(key, job.id, 1)
        who = verify_rank_token(key, credential)
        assert who is not None and (who.role, who.job, who.attempt) == ("rank", job.id, 1)

        callers = {
            "none": "",
            "alice": "tok-alice",
            "bob": "tok-bob",
            "rank": credential,
            "rank_other_job": rank_token(key, other.id, 1),
            "rank_ended": rank_token(key, ended.id, 1),
            "rank_forged": credential[:-4] + "0000",
            "node": "tok-node",
            "admin": "tok-admin",
        }
        stubs = {}
        for name, token in callers.items():
            channel = open_aio_channel(coordinator.address, token=token)
            channels.append(channel)
            stubs[name] = checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)
        # An ended attempt's credential, on its own job: expired.
        got = await _code(stubs["rank_ended"], "GetLatestCheckpoint", pb.GetLatestCheckpointRequest(job_id=ended.id))
        assert got[0] is DENIED and "has expired" in got[1]
        # A rank's credential names its attempt: another attempt of its own job is refused.
        got = await _code(stubs["rank"], "BeginCheckpoint", pb.BeginCheckpointRequest(job_id=job.id, attempt=2, step=1))
        assert got[0] is DENIED and "may not act for attempt 2" in got[1]

        with structlog.testing.capture_logs() as logs:
            for caller, want in EXPECTED.items():
                for method, (rpc, request) in calls(job.id).items():
                    before = _snapshot(db_url) if want is not OK else None
                    code, details = await _code(stubs[caller], rpc, request)
                    if want is OK:
                        assert code not in (grpc.StatusCode.UNAUTHENTICATED, DENIED), (caller, method, details)
                        assert not (code is HIDDEN and "no job with id" in details), (caller, method, details)
                    else:
                        assert code is want, (caller, method, code, details)
                        assert _snapshot(db_url) == before, (caller, method)
        denied = {(a["role"], a["method"].rsplit("/", 1)[-1]) for a in logs if a.get("outcome") == "denied"}
        for role, caller in (("user", "bob"), ("rank", "rank_other_job"), ("node", "node"), ("none", "none")):
            assert {(role, m) for m in calls(job.id)} <= denied, (caller, sorted(denied)[:5])
    finally:
        for channel in channels:
            await channel.close()
        await alice.close()
        await bob.close()
        await agent.stop()
        await coordinator.stop(0)
        await scheduler.stop()


@pytest.mark.parametrize("token", ["", "phr_", "phr_abc_1_" + "0" * 64, "phr_abc_x_" + "0" * 64, "phr_" + "a" * 500])
def test_malformed_rank_credentials_verify_as_nobody(token):
    assert verify_rank_token("00" * 32, token) is None


async def test_each_job_writes_only_under_its_tenants_prefix(db_url, tmp_path):
    """The coordinator owns its root (--checkpoint-root): alice's job writes under <root>/alice/<job>/, which the
    scheduler gives its ranks as PHALANX_CHECKPOINT_DIR=<root>/alice; a shard anywhere else is INVALID_ARGUMENT and
    writes nothing."""
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
    channel = open_aio_channel(coordinator.address, token="tok-alice")
    try:
        stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(channel)
        job = await alice.wait((await alice.submit("a", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        launch = next(launch for launch in agent.launched if launch.job_id == job.id)
        assert launch.env["PHALANX_CHECKPOINT_DIR"] == f"{root}/alice"
        mine = root / "alice" / job.id / "1" / "attempt-1"
        for uri in (
            "file:///etc/passwd",
            (root / "bob" / job.id / "x").as_uri(),
            (root / job.id / "x").as_uri(),
            f"file://{root}/alice/{job.id}/../other/x",
            "s3://bucket/x",
        ):
            shard = pb.Shard(rank=0, uri=uri, size_bytes=1, checksum="sha256:" + "0" * 64)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportShard(pb.ReportShardRequest(job_id=job.id, attempt=1, step=1, shard=shard))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, uri
            assert f"outside this job's storage prefix file://{root}/alice/{job.id}/" in err.value.details()
        assert _snapshot(db_url)[:2] == (0, 0)
        shard = pb.Shard(rank=0, uri=(mine / "rank-0.json").as_uri(), size_bytes=1, checksum="sha256:" + "0" * 64)
        done = await stub.ReportShard(pb.ReportShardRequest(job_id=job.id, attempt=1, step=1, shard=shard))
        assert done.state == "COMMITTED"
    finally:
        await channel.close()
        await alice.close()
        await agent.stop()
        await coordinator.stop(0)
        await scheduler.stop()
