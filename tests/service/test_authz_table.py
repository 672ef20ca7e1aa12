"""Every RPC of the scheduler's three services (Scheduler, NodeService, ServiceService), and of a node agent's
AgentLogs, against every kind of caller (issues 20, 31 and 33), each with the status it must get; after every
refusal the whole ledger (every table and column: jobs, attempts, allocations, ranks, assignments, nodes with their
acked revision and heartbeat, the clock with its leader lease, the change log, services, ...) is checked unchanged.
Every refusal runs first, from one still ledger; then the allowed calls, in the table's order. The checkpoint
coordinator's table is in test_coordinator_auth.py. Real scheduler, real gRPC, real ledger (SQLite and
PostgreSQL), the agent's real AgentLogs servicer.

Callers: no credential; a user of the owning tenant (alice) and of another (bob); the rank credential of alice's
running job, of bob's job, and of an ended attempt; the node token of node-0 (the node the calls name) and of
node-1; an admin. AgentLogs takes a log credential in the request rather than a token: each caller sends the best
it can get (alice and the admin: the scheduler's GetRankLogs answer for alice's job; bob: his own job's; the
others: their token), and only a credential for that job's attempt on that node reads it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from helpers.tokens import write_tokens
from sqlalchemy import Engine, MetaData, create_engine, select

from db.engine import make_engine
from db.migrate import ensure_rank_key
from db.models import Base
from phalanx.api.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    service_pb2,
    service_pb2_grpc,
)
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, node_logs_key, rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.node_agent import launcher
from services.node_agent.logs import AgentLogsServicer
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
    elif role == "logs":  # a credential in the request, no token: a refusal is PERMISSION_DENIED, also for "none"
        base.update(none=DENIED, alice=OK, admin=OK)
    return base


def scheduler_calls(job: str) -> list[tuple[str, object, str, bool]]:
    """(method, request, role, streaming); every refusal of the table runs before any allowed call."""
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
        ("ListPools", scheduler_pb2.ListPoolsRequest(), "list", False),
        ("CreatePool", scheduler_pb2.CreatePoolRequest(name="p1", tier="cluster", per_domain=1), "admin", False),
        ("DeletePool", scheduler_pb2.DeletePoolRequest(name="p1"), "admin", False),
        ("DrainNode", scheduler_pb2.DrainNodeRequest(node_name="node-1"), "admin", False),
        ("UndrainNode", scheduler_pb2.UndrainNodeRequest(node_name="node-1"), "admin", False),
        ("CancelJob", scheduler_pb2.CancelJobRequest(job_id=job), "user", False),
    ]


def service_calls(service: str) -> list[tuple[str, object, str, bool]]:
    """The ServiceService: a tenant's service is its own (another tenant gets NOT_FOUND, as for a job)."""
    template = common_pb2.JobSpec(replicas=1, gpus_per_replica=1, command=["hang"])
    other = common_pb2.JobSpec(replicas=1, gpus_per_replica=1, command=["hang", "v2"])
    new = service_pb2.ServiceSpec(name="svc-t", replicas=1, template=template)
    return [
        ("GetService", service_pb2.GetServiceRequest(name=service), "user", False),
        ("WatchEndpoints", service_pb2.WatchEndpointsRequest(name=service), "user", True),
        ("ListServices", service_pb2.ListServicesRequest(), "list", False),
        (
            "PushMetric",
            service_pb2.PushMetricRequest(service=service, metric="m", value=1.0, replica=-1),
            "user",
            False,
        ),
        ("ScaleService", service_pb2.ScaleServiceRequest(name=service, replicas=1), "user", False),
        ("UpdateService", service_pb2.UpdateServiceRequest(name=service, template=other), "user", False),
        ("RollbackService", service_pb2.RollbackServiceRequest(name=service), "user", False),
        ("CreateService", service_pb2.CreateServiceRequest(spec=new), "list", False),
        ("ApplyService", service_pb2.ApplyServiceRequest(spec=new), "list", False),
        ("DeleteService", service_pb2.DeleteServiceRequest(name=service), "user", False),
    ]


def node_calls(job: str, topology) -> list[tuple[str, object, str, bool]]:
    return [
        (
            "ReportReadiness",
            agent_pb2.ReportReadinessRequest(node_name="node-0", job_id=job, attempt=7, ready=True),
            "node",
            False,
        ),
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


_LEDGER_TABLES: dict[str, MetaData] = {}
_ENGINES: dict[str, Engine] = {}


def _snapshot(db_url: str) -> tuple:
    """The whole ledger: every row of every table (as the database has them, reflected once per database: the
    models' tables and any other a migration made), every column, in primary-key order. One engine per database
    for the whole test (a snapshot is taken after every refused call)."""
    engine = _ENGINES.get(db_url)
    if engine is None:
        engine = _ENGINES[db_url] = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
    meta = _LEDGER_TABLES.get(db_url)
    if meta is None:
        meta = MetaData()
        meta.reflect(engine)
        missing = {t.name for t in Base.metadata.sorted_tables} - set(meta.tables)
        assert not missing, f"the snapshot would miss the ledger tables {missing}"
        _LEDGER_TABLES[db_url] = meta
    with engine.connect() as conn:
        return tuple(
            (
                table.name,
                tuple(table.columns.keys()),
                tuple(map(tuple, conn.execute(select(table).order_by(*_order(table))).all())),
            )
            for table in meta.sorted_tables
        )


def ledger_diff(before: tuple, after: tuple) -> list[str]:
    """What changed between two snapshots: per table, the rows gone and new, and per row (by its first column) the
    columns that changed (for a failure report)."""
    out = []
    for (name, columns, old), (_, _, new) in zip(before, after):
        if old == new:
            continue
        olds, news = {r[0]: r for r in old}, {r[0]: r for r in new}
        for key in sorted(set(olds) | set(news), key=repr):
            was, now = olds.get(key), news.get(key)
            if was is None or now is None:
                out.append(f"{name} {key!r}: {'new' if was is None else 'gone'}: {str(now or was)[:200]}")
            elif was != now:
                changed = {c: (x, y) for c, x, y in zip(columns, was, now) if x != y}
                out.append(f"{name} {key!r}: {changed}")
    return out


def _order(table) -> list:
    return list(table.primary_key.columns) or list(table.columns)


def _quiet(db_url: str, hold: float = 1.3, timeout: float = 60.0) -> tuple:
    """A snapshot once the ledger has stood still for `hold` seconds: what the allowed calls before set going (a
    placement, the agents' acks and rank reports) has landed, so what changes next is the next call's doing. Stillness
    alone is not enough for acks: the scheduler keeps them in memory and writes them (at most once a second) with
    the next cycle that runs for another reason, and on PostgreSQL a cycle with nothing else to do runs only every
    5 s, longer than `hold`; so every node must also have acked, in the snapshot returned."""
    deadline = time.monotonic() + timeout
    last = _snapshot(db_url)
    while True:
        time.sleep(hold)
        now = _snapshot(db_url)
        # Still, and every node's assignments acked in the ledger: on a loaded host an agent's ack can land later
        # than `hold`, and would then show as the next (refused) call's doing. Read from the very snapshot returned
        # (a node's revision and acked revision are one row, read by one statement): a separate query after it could
        # see an ack that landed after the snapshot was read, and pass a snapshot that still lacks it.
        if now == last and not _unacked(now):
            return now
        assert time.monotonic() < deadline, (
            f"the ledger did not settle in {timeout:g}s: {ledger_diff(last, now)}, unacked {_unacked(now)}"
        )
        last = now


def _unacked(snapshot: tuple) -> list[str]:
    """The nodes of a snapshot whose assignments are not all acked in it (acked_revision < revision)."""
    for name, columns, rows in snapshot:
        if name == "nodes":
            at = {c: i for i, c in enumerate(columns)}
            return [r[at["name"]] for r in rows if r[at["acked_revision"]] < r[at["revision"]]]
    raise AssertionError("the snapshot has no nodes table")


def quiet_settings(db_url: str) -> SchedulerSettings:
    """A scheduler whose ledger stays still between calls once the test holds its agents' heartbeats: no timer of
    its own fires within the test (its timeout, 300 s): nodes are not lost for an hour, the gangs' launch deadline is
    an hour, heartbeats reach the ledger at most hourly, the leader's lease is renewed every 20 minutes.

    The launch deadline matters because the tests' jobs run `hang` (LiteAgent: the ranks never report RUNNING, so the
    job stays RUNNING with its ranks ASSIGNED): at the default 60 s the scheduler tore the gang down (LAUNCH_TIMEOUT,
    requeued: a new attempt, released allocations, ...) in the middle of the table on a loaded host, and that showed
    as the doing of whichever refused call was checked then."""
    return SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(["node-0", "node-1"]),
        lease_timeout=3600.0,
        launch_timeout=3600.0,
        heartbeat_persist_interval=3600.0,
        leader_lease_s=3600.0,
    )


async def serve_logs(state_dir, key: str) -> tuple[grpc.aio.Server, str]:
    """The node agent's AgentLogs servicer, checking credentials with `key`, over `state_dir`."""
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentLogsServicer_to_server(AgentLogsServicer(lambda: key, state_dir, lambda *a: False), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


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


@pytest.mark.timeout(300)
async def test_every_scheduler_and_node_rpc_against_every_caller(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    scheduler = await serve(quiet_settings(db_url), tokens=TokenStore(tokens))
    agents = [LiteAgent(scheduler.address, f"node-{i}", token=f"tok-node-{i}") for i in range(2)]
    for agent in agents:
        await agent.start()
    channels: list[grpc.aio.Channel] = []
    servers: list[grpc.aio.Server] = []
    logs_address = ""

    def stubs(token: str):
        channel = open_aio_channel(scheduler.address, token=token)
        channels.append(channel)
        return scheduler_pb2_grpc.SchedulerStub(channel), agent_pb2_grpc.NodeServiceStub(channel)

    def service_stub(token: str):
        channel = open_aio_channel(scheduler.address, token=token)
        channels.append(channel)
        return service_pb2_grpc.ServiceServiceStub(channel)

    def logs_stub(token: str):
        channel = open_aio_channel(logs_address, token=token)  # the token too: AgentLogs must not take it instead
        channels.append(channel)
        return agent_pb2_grpc.AgentLogsStub(channel)

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
        svc_template = common_pb2.JobSpec(replicas=1, gpus_per_replica=1, command=["hang"])
        await service_stub("tok-alice").CreateService(
            service_pb2.CreateServiceRequest(
                spec=service_pb2.ServiceSpec(name="svc-a", replicas=1, template=svc_template)
            )
        )
        await alice.CancelJob(scheduler_pb2.CancelJobRequest(job_id=ended))
        # What the refused deletes name exists while they are refused (the allowed calls make it again later).
        admin_stub = stubs("tok-admin")[0]
        await admin_stub.SetQueue(scheduler_pb2.SetQueueRequest(spec=scheduler_pb2.QueueSpec(name="q1")))
        await admin_stub.CreatePool(scheduler_pb2.CreatePoolRequest(name="p1", tier="cluster", per_domain=1))
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
        # AgentLogs: the log of rank 0 of alice's job, served by its node's servicer; each caller's best credential.
        source = (await alice.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=mine, rank=0))).sources[0]
        state_dir = tmp_path / "agent-logs"
        log_path = launcher.rank_paths(state_dir, mine, 1, 0)[1]
        log_path.parent.mkdir(parents=True)
        log_path.write_bytes(b"alice's rank 0 says hello\n")
        logs_server, logs_address = await serve_logs(state_dir, node_logs_key(key, source.node))
        servers.append(logs_server)
        admin_cred = (await stubs("tok-admin")[0].GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=mine))).sources
        bob_cred = (await bob.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=theirs))).sources[0].credential
        credential_of = {**tokens_of, "alice": source.credential, "admin": admin_cred[0].credential, "bob": bob_cred}
        assert source.credential and bob_cred and credential_of["admin"]

        def read_log(caller: str) -> agent_pb2.ReadRankLogRequest:
            return agent_pb2.ReadRankLogRequest(credential=credential_of[caller], job_id=mine, attempt=1, rank=0)

        callers = {c: (*stubs(t), logs_stub(t), service_stub(t)) for c, t in tokens_of.items()}
        table = [(m, r, role, s, 0) for m, r, role, s in scheduler_calls(mine)]
        table += [(m, r, role, s, 3) for m, r, role, s in service_calls("svc-a")]
        table += [(m, r, role, s, 1) for m, r, role, s in node_calls(mine, agents[0].topology())]
        table += [("ReadRankLog", read_log, "logs", True, 2)]
        for agent in agents:  # from here on nothing but the calls of the table writes the ledger
            agent.hold_heartbeats = True
        # First every refusal of the table, from one still ledger: each must leave it exactly as it was. (A caller's
        # status depends on its role, not on what the allowed calls change, so the refusals need not wait for them;
        # waiting for the ledger to stand still after each RPC's allowed calls took most of this test's time.)
        before = await asyncio.to_thread(_quiet, db_url)
        for method, request, role, streaming, service in table:
            expected = _row(role)
            for caller in (c for c in CALLERS if expected[c] is not OK):
                message = request(caller) if callable(request) else request
                code, details = await _status(callers[caller][service], method, message, streaming)
                assert code is expected[caller], (method, caller, code, details)
                after = _snapshot(db_url)
                assert after == before, (method, caller, ledger_diff(before, after))
        # Then the allowed callers, in the table's order (a queue is set before it is deleted, ...).
        for method, request, role, streaming, service in table:
            expected = _row(role)
            for caller in (c for c in CALLERS if expected[c] is OK):
                message = request(caller) if callable(request) else request
                code, details = await _status(callers[caller][service], method, message, streaming)
                assert code not in (UNAUTH, DENIED), (method, caller, code, details)
                assert not (code is HIDDEN and ("no job" in details or "no service" in details)), (
                    method,
                    caller,
                    details,
                )
            if method == "ReadRankLog":  # the allowed callers read the log itself
                call = callers["alice"][2].ReadRankLog(read_log("alice"))
                assert b"".join([chunk.data async for chunk in call]) == b"alice's rank 0 says hello\n"
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(0)
        for agent in agents:
            await agent.stop()
        await scheduler.stop()
        engine = _ENGINES.pop(db_url, None)
        if engine is not None:
            engine.dispose()
