"""The scheduler's gRPC API against its callers. Real scheduler with a tokens file, real gRPC, real ledger (SQLite
and PostgreSQL), a protocol-level agent.

Threats (who, what they control, what they must not reach):

1. A tenant (bob, a valid user token) names another tenant's job id in reads (GetJob, ListJobs, WatchJobs,
   GetRankLogs): he must not learn that it exists, let alone its spec or state.
2. The same tenant cancels or checkpoints another tenant's job: it must keep running, untouched.
3. Anyone forges a credential (a made-up token, a rank credential with a wrong or foreign MAC, a token in another
   scheme): UNAUTHENTICATED, whatever it names.
4. A node agent's token (a host that is compromised, or a rank that reads it) calls the user API (submit, read,
   cancel): PERMISSION_DENIED; the agent API is for agents only, and a user token may not register a node.
5. A rank's own credential (PHALANX_JOB_TOKEN, in every rank's environment) calls the scheduler: it reaches the
   checkpoint coordinator only, never the job API.

Every authorization row, per method and caller, is in tests/service/test_authz_table.py; the fuzz of refusals in
tests/service/test_authz_fuzz.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers.tokens import write_tokens

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

UNAUTH, DENIED, HIDDEN = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND
ENTRIES = [
    ("tok-alice", "alice", "user", ""),
    ("tok-bob", "bob", "user", ""),
    ("tok-admin", "ops", "admin", ""),
    ("tok-node-0", "nodes", "node", "node-0"),
]


class Cluster:
    def __init__(self, scheduler, agent, job: str, rank_key: str) -> None:
        self.scheduler, self.agent, self.job, self.rank_key = scheduler, agent, job, rank_key
        self.channels: list[grpc.aio.Channel] = []

    def stub(self, token: str, kind=scheduler_pb2_grpc.SchedulerStub):
        channel = open_aio_channel(self.scheduler.address, token=token)
        self.channels.append(channel)
        return kind(channel)

    async def state(self) -> int:
        return (await self.stub("tok-alice").GetJob(scheduler_pb2.GetJobRequest(job_id=self.job))).state


@pytest.fixture
async def cluster(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    scheduler = await serve(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"])),
        tokens=TokenStore(tokens),
    )
    agent = LiteAgent(scheduler.address, "node-0", token="tok-node-0")
    await agent.start()
    engine = make_engine(db_url)
    with engine.begin() as conn:
        key = ensure_rank_key(conn)
    engine.dispose()
    c = Cluster(scheduler, agent, "", key)
    try:
        alice = c.stub("tok-alice")
        spec = common_pb2.JobSpec(name="secret-run", replicas=1, gpus_per_replica=1, command=["hang"])
        c.job = (await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).id
        for _ in range(200):
            if await c.state() == common_pb2.JOB_STATE_RUNNING:
                break
            await asyncio.sleep(0.05)
        assert await c.state() == common_pb2.JOB_STATE_RUNNING
        yield c
    finally:
        for channel in c.channels:
            await channel.close()
        await agent.stop()
        await scheduler.stop()


async def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_1_a_tenant_cannot_read_another_tenants_job(cluster):
    bob = cluster.stub("tok-bob")
    for call in (
        bob.GetJob(scheduler_pb2.GetJobRequest(job_id=cluster.job)),
        bob.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=cluster.job)),
    ):
        code, details = await _code(call)
        assert code is HIDDEN and "secret-run" not in details
    listed = await bob.ListJobs(scheduler_pb2.ListJobsRequest())
    assert cluster.job not in [j.id for j in listed.jobs]
    watch = bob.WatchJobs(scheduler_pb2.WatchJobsRequest(job_ids=[cluster.job]), timeout=1.5)
    seen = []
    try:
        async for event in watch:
            seen.append(event)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (HIDDEN, grpc.StatusCode.DEADLINE_EXCEEDED), exc
    assert all(cluster.job not in str(event) for event in seen)


async def test_2_a_tenant_cannot_cancel_or_checkpoint_another_tenants_job(cluster):
    bob = cluster.stub("tok-bob")
    for call in (
        bob.CancelJob(scheduler_pb2.CancelJobRequest(job_id=cluster.job)),
        bob.CheckpointJob(scheduler_pb2.CheckpointJobRequest(job_id=cluster.job)),
    ):
        code, _ = await _code(call)
        assert code is HIDDEN
    assert await cluster.state() == common_pb2.JOB_STATE_RUNNING


@pytest.mark.parametrize(
    "forged",
    [
        "tok-mallory",  # made up
        "tok-alicf",  # a near miss
        "Basic tok-alice",  # another scheme: sent as "Bearer Basic tok-alice"
        "phr_{job}_1_" + "0" * 64,  # a rank credential with a wrong MAC
        "{foreign}",  # a rank credential signed with another ledger's key
        "phr_{job}_1_",  # no MAC at all
    ],
)
async def test_3_a_forged_credential_is_unauthenticated(cluster, forged):
    token = forged.format(job=cluster.job, foreign=rank_token("11" * 32, cluster.job, 1))
    stub = cluster.stub(token)
    for call in (
        stub.GetJob(scheduler_pb2.GetJobRequest(job_id=cluster.job)),
        stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=cluster.job)),
    ):
        code, _ = await _code(call)
        assert code is UNAUTH, (forged, code)
    assert await cluster.state() == common_pb2.JOB_STATE_RUNNING


async def test_4_an_agent_token_cannot_use_the_user_api_nor_a_user_the_agent_api(cluster):
    node = cluster.stub("tok-node-0")
    spec = common_pb2.JobSpec(name="from-a-node", replicas=1, gpus_per_replica=1, command=["hang"])
    for call in (
        node.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec)),
        node.GetJob(scheduler_pb2.GetJobRequest(job_id=cluster.job)),
        node.ListJobs(scheduler_pb2.ListJobsRequest()),
        node.CancelJob(scheduler_pb2.CancelJobRequest(job_id=cluster.job)),
        node.DrainNode(scheduler_pb2.DrainNodeRequest(node_name="node-0")),
    ):
        code, _ = await _code(call)
        assert code is DENIED
    user_as_agent = cluster.stub("tok-alice", agent_pb2_grpc.NodeServiceStub)
    code, _ = await _code(
        user_as_agent.RegisterNode(
            agent_pb2.RegisterNodeRequest(node_name="node-9", topology=cluster.agent.topology(), address="127.0.0.1")
        )
    )
    assert code is DENIED
    assert await cluster.state() == common_pb2.JOB_STATE_RUNNING


async def test_5_a_rank_credential_reaches_no_scheduler_method(cluster):
    rank = cluster.stub(rank_token(cluster.rank_key, cluster.job, 1))
    for call in (
        rank.GetJob(scheduler_pb2.GetJobRequest(job_id=cluster.job)),
        rank.CancelJob(scheduler_pb2.CancelJobRequest(job_id=cluster.job)),
        rank.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=cluster.job)),
    ):
        code, _ = await _code(call)
        assert code is DENIED
    assert await cluster.state() == common_pb2.JOB_STATE_RUNNING
