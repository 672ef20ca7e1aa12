"""Every RPC of the scheduler's two services against every kind of caller (issue 20), each with the status it must
get; after every refusal the ledger is checked unchanged. The checkpoint coordinator's table is in
test_coordinator_auth.py. Real scheduler, real gRPC, real ledger (SQLite and PostgreSQL).

Callers: no credential; a user of the owning tenant (alice) and of another (bob); the rank credential of alice's
running job, of bob's job, and of an ended attempt; the node token of node-0 (the node the calls name) and of
node-1; an admin.
"""

from __future__ import annotations

import asyncio

import grpc
from helpers.tokens import write_tokens
from sqlalchemy import create_engine, text

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

OK = "ok"
UNAUTH, DENIED, HIDDEN = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND
CALLERS = ("none", "bob", "rank", "rank_other", "rank_ended", "node", "node_other", "alice", "admin")
ENTRIES = [
    ("tok-alice", "alice", "user", ""),
    ("tok-bob", "bob", "user", ""),
    ("tok-admin", "ops", "admin", ""),
    ("tok-node-0", "nodes", "node", "node-0"),
    ("tok-node-1", "nodes", "node", "node-1"),
]


def _row(role: str) -> dict[str, object]:
    """One RPC's expected status per caller, from what its role may do: `user` (alice the owner, bob another
    tenant), `admin` (admins only), `node` (node-0 only), `list` (any user or admin, scoped to its own)."""
    base: dict[str, object] = {c: DENIED for c in CALLERS}
    base["none"] = UNAUTH
    if role == "user":
        base.update(alice=OK, bob=HIDDEN, admin=OK)
    elif role == "list":
        base.update(alice=OK, bob=OK, admin=OK)
    elif role == "admin":
        base.update(admin=OK)
    elif role == "node":
        base.update(node=OK)
    return base


def scheduler_calls(job: str) -> list[tuple[str, object, str, bool]]:
    """(method, request, role, streaming); refused ones run before allowed ones, so a change is the allowed."""
    spec = common_pb2.JobSpec(name="t", replicas=1, gpus_per_replica=1, command=["hang"])
    return [
        ("GetJob", scheduler_pb2.GetJobRequest(job_id=job), "user", False),
        ("CheckpointJob", scheduler_pb2.CheckpointJobRequest(job_id=job), "user", False),
        ("GetRankLogs", scheduler_pb2.GetRankLogsRequest(job_id=job), "user", False),
        ("WatchJobs", scheduler_pb2.WatchJobsRequest(job_ids=[job]), "user", True),
        ("ListJobs", scheduler_pb2.ListJobsRequest(), "list", False),
        ("GetGoodput", scheduler_pb2.GetGoodputRequest(), "list", False),
        ("ListNodes", scheduler_pb2.ListNodesRequest(), "list", False),
        ("ListQueues", scheduler_pb2.ListQueuesRequest(), "list", False),
        ("SubmitJob", scheduler_pb2.SubmitJobRequest(spec=spec, request_id="table"), "list", False),
        ("SetQueue", scheduler_pb2.SetQueueRequest(spec=scheduler_pb2.QueueSpec(name="q1")), "admin", False),
        ("DeleteQueue", scheduler_pb2.DeleteQueueRequest(name="q1"), "admin", False),
        ("DrainNode", scheduler_pb2.DrainNodeRequest(node_name="node-1"), "admin", False),
        ("UndrainNode", scheduler_pb2.UndrainNodeRequest(node_name="node-1"), "admin", False),
        ("CancelJob", scheduler_pb2.CancelJobRequest(job_id=job), "user", False),
    ]


def node_calls(job: str, topology) -> list[tuple[str, object, str, bool]]:
    return [
        ("Heartbeat", agent_pb2.HeartbeatRequest(node_name="node-0"), "node", False),
        ("AckAssignments", agent_pb2.AckAssignmentsRequest(node_name="node-0", revision=0), "node", False),
        (
            "StreamAssignments",
            agent_pb2.StreamAssignmentsRequest(node_name="node-0", after_revision=1 << 40),
            "node",
            True,
        ),
        (
            "ReportAttemptReleased",
            agent_pb2.ReportAttemptReleasedRequest(node_name="node-0", job_id=job, attempt=7),
            "node",
            False,
        ),
        (
            "ReportRankStatus",
            agent_pb2.ReportRankStatusRequest(
                node_name="node-0", job_id=job, attempt=7, rank=0, state=common_pb2.RANK_STATE_RUNNING
            ),
            "node",
            False,
        ),
        (
            "RegisterNode",
            agent_pb2.RegisterNodeRequest(node_name="node-0", topology=topology, address="127.0.0.1"),
            "node",
            False,
        ),
    ]


def _snapshot(db_url: str) -> tuple:
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        got = tuple(
            tuple(map(tuple, conn.execute(text(q)).all()))
            for q in (
                "SELECT id, state, attempt, message, priority FROM jobs ORDER BY id",
                "SELECT job_id, node_id, gpu_index FROM allocations WHERE released_at IS NULL ORDER BY 1, 2, 3",
                "SELECT name, state, cordoned, agent_instance, address FROM nodes ORDER BY name",
                "SELECT name, max_priority FROM queues ORDER BY name",
                "SELECT job_id, requested_at FROM checkpoint_requests ORDER BY job_id",
                "SELECT job_id, attempt, rank, state FROM ranks ORDER BY 1, 2, 3",
            )
        )
    engine.dispose()
    return got


async def _status(stub, method: str, request, streaming: bool) -> tuple[object, str]:
    try:
        if streaming:
            call = getattr(stub, method)(request, timeout=1.5)
            try:
                async for _ in call:
                    break
            finally:
                call.cancel()
        else:
            await getattr(stub, method)(request, timeout=10)
    except grpc.aio.AioRpcError as exc:
        if streaming and exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return OK, ""  # an open stream with nothing to send yet: taken
        return exc.code(), exc.details()
    return OK, ""


async def test_every_scheduler_and_node_rpc_against_every_caller(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0", "node-1"]), lease_timeout=60.0
        ),
        tokens=TokenStore(tokens),
    )
    agents = [LiteAgent(scheduler.address, f"node-{i}", token=f"tok-node-{i}") for i in range(2)]
    for agent in agents:
        await agent.start()
    channels: list[grpc.aio.Channel] = []

    def stubs(token: str):
        channel = open_aio_channel(scheduler.address, token=token)
        channels.append(channel)
        return scheduler_pb2_grpc.SchedulerStub(channel), agent_pb2_grpc.NodeServiceStub(channel)

    try:
        alice, _ = stubs("tok-alice")
        bob, _ = stubs("tok-bob")

        async def running(stub, name: str) -> str:
            spec = common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=1, command=["hang"])
            job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
            for _ in range(200):
                if (
                    await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))
                ).state == common_pb2.JOB_STATE_RUNNING:
                    return job.id
                await asyncio.sleep(0.05)
            raise AssertionError(f"{name} did not run")

        mine, theirs, ended = await running(alice, "mine"), await running(bob, "theirs"), await running(alice, "ended")
        await alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=ended))
        engine = make_engine(db_url)
        with engine.begin() as conn:
            key = ensure_rank_key(conn)
        engine.dispose()
        tokens_of = {
            "none": "",
            "alice": "tok-alice",
            "bob": "tok-bob",
            "rank": rank_token(key, mine, 1),
            "rank_other": rank_token(key, theirs, 1),
            "rank_ended": rank_token(key, ended, 1),
            "node": "tok-node-0",
            "node_other": "tok-node-1",
            "admin": "tok-admin",
        }
        callers = {c: stubs(t) for c, t in tokens_of.items()}
        table = [(m, r, role, s, 0) for m, r, role, s in scheduler_calls(mine)]
        table += [(m, r, role, s, 1) for m, r, role, s in node_calls(mine, agents[0].topology())]
        for method, request, role, streaming, service in table:
            expected = _row(role)
            for caller in CALLERS:  # the refused callers first: each must leave the ledger as it was
                want = expected[caller]
                before = _snapshot(db_url) if want is not OK else None
                code, details = await _status(callers[caller][service], method, request, streaming)
                if want is OK:
                    assert code not in (UNAUTH, DENIED), (method, caller, code, details)
                    assert not (code is HIDDEN and "no job" in details), (method, caller, details)
                else:
                    assert code is want, (method, caller, code, details)
                    assert _snapshot(db_url) == before, (method, caller)
    finally:
        for channel in channels:
            await channel.close()
        for agent in agents:
            await agent.stop()
        await scheduler.stop()
