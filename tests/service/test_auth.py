"""Authentication, tenancy, admin node drain, token rotation and per-tenant limits against real servers on
loopback (the scheduler in-process with --tokens, protocol-level agents with node tokens)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import pytest
import structlog.testing
from helpers.waits import eventually, holds, next_cycle

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli.main import main as cli_main
from phalanx.client import (
    AsyncClient,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, hash_token, parse_tokens
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.common.auth import TenantLimits
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

TOKENS = {
    "alice": ("tok-alice", "alice", "user"),
    "bob": ("tok-bob", "bob", "user"),
    "admin": ("tok-admin", "ops", "admin"),
    "node": ("tok-node-0", "nodes", "node", "node-0"),
    "svc": ("tok-svc", "cluster", "service"),
}
# Each node its own token naming it (a node token acts only as its node).
NODE_TOKENS = [(f"tok-node-{i}", "nodes", "node", f"node-{i}") for i in range(1, 4)]


def write_tokens(path, entries) -> None:
    lines = [
        f"- {{token_sha256: {hash_token(e[0])}, tenant: {e[1]}, role: {e[2]}"
        + (f", node: {e[3]}}}" if len(e) > 3 else "}")
        for e in [*entries, *NODE_TOKENS]
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


class AuthCluster:
    def __init__(self, db_url, tmp_path, nodes=2, limits=None):
        self.tokens_path = tmp_path / "tokens.yaml"
        write_tokens(self.tokens_path, TOKENS.values())
        self.names = [f"node-{i}" for i in range(nodes)]
        self.settings = SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(self.names),
            lease_timeout=5.0,
            heartbeat_interval=0.2,
        )
        self.limits = limits

    async def __aenter__(self):
        self.store = TokenStore(self.tokens_path, check_interval=0.1)
        self.scheduler = await serve(self.settings, tokens=self.store, limits=self.limits)
        self.address = self.scheduler.address
        self.agents = {n: LiteAgent(self.address, n, token=f"tok-{n}") for n in self.names}
        for agent in self.agents.values():
            await agent.start()
        self.clients = {k: AsyncClient(self.address, token=v[0], retries=0) for k, v in TOKENS.items()}
        return self

    async def __aexit__(self, *exc):
        for c in self.clients.values():
            await c.close()
        for agent in self.agents.values():
            await agent.stop()
        await self.scheduler.stop()


SCHEDULER_CALLS = [
    (
        "SubmitJob",
        scheduler_pb2.SubmitJobRequest(
            spec=common_pb2.JobSpec(name="x", replicas=1, gpus_per_replica=1, command=["run"])
        ),
    ),
    ("GetJob", scheduler_pb2.GetJobRequest(job_id="0123456789ab")),
    ("ListJobs", scheduler_pb2.ListJobsRequest()),
    ("CancelJob", scheduler_pb2.CancelJobRequest(job_id="0123456789ab")),
    ("ListNodes", scheduler_pb2.ListNodesRequest()),
    ("CheckpointJob", scheduler_pb2.CheckpointJobRequest(job_id="0123456789ab")),
    ("GetGoodput", scheduler_pb2.GetGoodputRequest()),
    ("DrainNode", scheduler_pb2.DrainNodeRequest(node_name="node-0")),
    ("UndrainNode", scheduler_pb2.UndrainNodeRequest(node_name="node-0")),
]


async def _code(coro) -> grpc.StatusCode | None:
    try:
        result = await coro
        if hasattr(result, "__aiter__"):
            async for _ in result:
                break
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return None


async def test_no_token_or_an_unknown_one_is_unauthenticated_on_every_scheduler_rpc(db_url, tmp_path):
    async with AuthCluster(db_url, tmp_path) as c:
        for token in ("", "not-a-token"):
            channel = open_aio_channel(c.address, token=token)
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for name, request in SCHEDULER_CALLS:
                assert await _code(getattr(stub, name)(request, timeout=5)) is grpc.StatusCode.UNAUTHENTICATED, name
            call = stub.WatchJobs(scheduler_pb2.WatchJobsRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            await channel.close()
        # health stays open
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(c.address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_tenants_see_and_cancel_only_their_own_jobs_and_admin_sees_all(db_url, tmp_path):
    async with AuthCluster(db_url, tmp_path) as c:
        alice, bob, admin = c.clients["alice"], c.clients["bob"], c.clients["admin"]
        a = await alice.submit("a", 1, 1, ["run"])
        b = await bob.submit("b", 1, 1, ["run"])
        assert a.tenant == "alice" and b.tenant == "bob"
        assert [j.id for j in await alice.list_jobs()] == [a.id]
        assert [j.id for j in await bob.list_jobs()] == [b.id]
        assert {j.id for j in await admin.list_jobs()} == {a.id, b.id}
        for call in (alice.get_job(b.id), alice.cancel(b.id), alice.checkpoint(b.id)):
            with pytest.raises(NotFoundError) as err:
                await call
            assert b.id in err.value.message  # the same answer as for a job that does not exist
        with pytest.raises(NotFoundError):
            async for _ in alice.watch([b.id], timeout=5):
                pass
        assert (await bob.get_job(b.id)).state.value != "CANCELLED"
        # a tenant reusing another's request id gets a job of its own
        r1 = await alice.submit("r", 1, 1, ["run"], request_id="same-key")
        r2 = await bob.submit("r", 1, 1, ["run"], request_id="same-key")
        assert r1.id != r2.id and r2.tenant == "bob"
        assert (await alice.submit("r", 1, 1, ["run"], request_id="same-key")).id == r1.id
        # watching every job: alice hears only of hers
        seen: list[str] = []

        async def watch_all():
            async for job in alice.watch(timeout=10):
                seen.append(job.id)

        task = asyncio.create_task(watch_all())
        fanout = c.scheduler.service.fanout
        await eventually(lambda: holds(lambda: fanout.watched), what="alice's watch subscribed")
        await bob.cancel(b.id)
        await alice.cancel(a.id)
        await eventually(lambda: _async(a.id in seen), what="alice's cancel seen")
        task.cancel()
        assert b.id not in seen
        # goodput: a user's totals count its own jobs only
        report = await alice.goodput()
        assert report.job_count == 2 and {j.job_id for j in report.jobs} <= {a.id, r1.id}
        assert (await admin.goodput()).job_count == 4
        # the admin reads and cancels anyone's job
        assert (await admin.get_job(r2.id)).tenant == "bob"
        assert (await admin.cancel(r2.id)).state.value == "CANCELLED"


async def _async(value):
    return value


async def test_roles_node_credentials_cannot_use_the_job_api_and_clients_cannot_register_nodes(db_url, tmp_path):
    async with AuthCluster(db_url, tmp_path) as c:
        for key in ("alice", "admin"):
            channel = open_aio_channel(c.address, token=TOKENS[key][0])
            stub = agent_pb2_grpc.NodeServiceStub(channel)
            req = agent_pb2.RegisterNodeRequest(node_name="evil", topology=c.agents["node-0"].topology())
            assert await _code(stub.RegisterNode(req, timeout=5)) is grpc.StatusCode.PERMISSION_DENIED
            await channel.close()
        node_client = AsyncClient(c.address, token="tok-node-0", retries=0)
        with pytest.raises(PermissionDeniedError):
            await node_client.list_jobs()
        await node_client.close()
        with pytest.raises(PermissionDeniedError):
            await c.clients["alice"].drain_node("node-0")
        assert {n.name for n in await c.clients["admin"].nodes()} == set(c.names)


@pytest.mark.slow
async def test_admin_drains_and_undrains_a_node_and_the_drain_survives_reregistration(db_url, tmp_path):
    async with AuthCluster(db_url, tmp_path, nodes=2) as c:
        admin, alice = c.clients["admin"], c.clients["alice"]
        with pytest.raises(NotFoundError):
            await admin.drain_node("no-such-node")
        node = await admin.drain_node("node-0", reason="maintenance")
        assert node.state.value == "DRAINED" and "maintenance" in node.message
        # a drained node gets no work: two 8-GPU gangs, one runs on node-1, the other waits
        j1 = await alice.submit("one", 1, 8, ["run"])
        j2 = await alice.submit("two", 1, 8, ["run"])
        running = await alice.wait(j1.id, ["RUNNING"], timeout=10)
        assert {a.node for a in running.allocations} == {"node-1"}
        await next_cycle(c.scheduler.service)
        assert (await alice.get_job(j2.id)).state.value == "PENDING"
        # the agent restarts and registers again: still DRAINED
        agent = c.agents["node-0"]
        await agent.stop()
        c.agents["node-0"] = agent = LiteAgent(c.address, "node-0", token="tok-node-0")
        await agent.start()
        state = {n.name: n.state.value for n in await admin.nodes()}
        assert state["node-0"] == "DRAINED"
        await next_cycle(c.scheduler.service)  # the registration's cycle and one after it: still no room for j2
        assert (await alice.get_job(j2.id)).state.value == "PENDING"
        # undrain: READY again, the waiting gang runs there
        node = await admin.undrain_node("node-0")
        assert node.state.value == "READY"
        running = await alice.wait(j2.id, ["RUNNING"], timeout=10)
        assert {a.node for a in running.allocations} == {"node-0"}


async def test_tokens_rotate_without_a_restart(db_url, tmp_path):
    async with AuthCluster(db_url, tmp_path) as c:
        assert await c.clients["alice"].list_jobs() == []
        entries = [v for k, v in TOKENS.items() if k != "alice"] + [("tok-alice-2", "alice", "user")]
        time.sleep(0.01)
        write_tokens(c.tokens_path, entries)

        async def old_refused():
            try:
                await c.clients["alice"].list_jobs()
            except UnauthenticatedError:
                return True
            return False

        await eventually(old_refused, timeout=5, what="the removed token refused")
        fresh = AsyncClient(c.address, token="tok-alice-2", retries=0)
        assert await fresh.list_jobs() == []
        await fresh.close()


async def test_rate_limit_and_pending_cap_answer_resource_exhausted_and_write_nothing(db_url, tmp_path):
    limits = TenantLimits(rate=1000.0, burst=5, max_pending=3)
    async with AuthCluster(db_url, tmp_path, limits=limits) as c:
        alice, bob = c.clients["alice"], c.clients["bob"]
        for i in range(3):
            await alice.submit(f"big{i}", 2, 8, ["run"], priority=-i)  # the first runs, the other two wait
        await eventually(lambda: _pending_count(alice, 2), what="two pending")
        await alice.submit("p", 2, 8, ["run"])  # third pending: at the cap
        with pytest.raises(ResourceExhaustedError) as err:
            await alice.submit("over", 2, 8, ["run"])
        assert "pending" in err.value.message
        assert len(await alice.list_jobs()) == 4
        # bob is not affected by alice's cap
        await bob.submit("b", 2, 8, ["run"])
    # a burst of 5, then refused; another tenant still gets in
    limits = TenantLimits(rate=0.5, burst=5)
    async with AuthCluster(db_url, tmp_path, limits=limits) as c:
        alice, bob = c.clients["alice"], c.clients["bob"]
        for i in range(5):
            await alice.submit(f"s{i}", 1, 1, ["run"])
        with pytest.raises(ResourceExhaustedError) as err:
            await alice.submit("s5", 1, 1, ["run"])
        assert "rate limit" in err.value.message
        assert len([j for j in await alice.list_jobs() if j.name.startswith("s")]) == 5
        await bob.submit("b", 1, 1, ["run"])


async def _pending_count(client, n):
    return sum(1 for j in await client.list_jobs() if j.state.value == "PENDING") == n


def test_token_file_parsing_refuses_bad_entries(tmp_path):
    good = parse_tokens(f"- {{token_sha256: {hash_token('x')}, tenant: t, role: admin, max_pending: 5}}\n")
    ident = good[hash_token("x")]
    assert (ident.tenant, ident.role, ident.max_pending) == ("t", "admin", 5)
    for text in (
        "- {token_sha256: abc, tenant: t, role: user}",
        f"- {{token_sha256: {hash_token('x')}, tenant: t, role: root}}",
        "{a: 1}",
        f"- {{token_sha256: {hash_token('x')}, role: user}}",
    ):
        with pytest.raises(ValueError):
            parse_tokens(text)


def test_phalanx_token_new_prints_a_token_and_its_entry(capsys):
    assert cli_main(["token", "new", "--tenant", "alice"]) == 0
    out = capsys.readouterr().out
    token = out.split("token: ", 1)[1].split()[0]
    assert hash_token(token) in out and "tenant: alice" in out and "role: user" in out
    assert cli_main(["token", "new", "--tenant", "ops", "--role", "admin", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["entry"] == {"token_sha256": hash_token(doc["token"]), "tenant": "ops", "role": "admin"}
    store_text = f"- {json.dumps(doc['entry'])}\n"
    assert parse_tokens(store_text)[hash_token(doc["token"])].role == "admin"
    assert cli_main(["token", "new", "--tenant", "x", "--role", "root"]) == 2


def _json(out: str):
    """The CLI's JSON document (the in-process scheduler's log lines go to service_logs, not to stdout)."""
    return json.loads(out)


async def test_cli_node_drain_and_undrain(db_url, tmp_path, capsys, service_logs):
    async with AuthCluster(db_url, tmp_path) as c:

        def run(*argv):
            return cli_main(["--scheduler", c.address, "--token", "tok-admin", *argv])

        assert await asyncio.to_thread(run, "node", "drain", "node-1", "--json") == 0
        assert _json(capsys.readouterr().out)["state"] == "DRAINED"
        assert await asyncio.to_thread(run, "node", "undrain", "node-1", "--json") == 0
        assert _json(capsys.readouterr().out)["state"] == "READY"
        assert await asyncio.to_thread(run, "node", "drain", "nope") == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        rc = await asyncio.to_thread(
            cli_main, ["--scheduler", c.address, "--token", "tok-alice", "node", "drain", "node-1"]
        )
        assert rc == 1 and "PERMISSION_DENIED" in capsys.readouterr().err
        rc = await asyncio.to_thread(cli_main, ["--scheduler", c.address, "--token", "", "jobs"])
        assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


async def test_a_tenants_unix_user_from_the_tokens_file_goes_with_its_launches(db_url, tmp_path):
    """Ranks run as their tenant's Unix user (the tokens file's `unix_user`); a tenant without one gets the
    agents' --run-as (an empty run_as in the launch)."""
    async with AuthCluster(db_url, tmp_path, nodes=1) as c:
        write_tokens(c.tokens_path, TOKENS.values())
        text = c.tokens_path.read_text()
        first = text.index("role: user}")
        text = text[:first] + "role: user, unix_user: alice_ml}" + text[first + len("role: user}") :]
        c.tokens_path.write_text(text)
        await eventually(lambda: holds(lambda: c.store.unix_user("alice") == "alice_ml"), what="the file reloaded")
        a = await c.clients["alice"].submit("a", 1, 1, ["run"])
        b = await c.clients["bob"].submit("b", 1, 1, ["run"])
        agent = c.agents["node-0"]
        await eventually(lambda: _has(agent, {a.id, b.id}), what="both launches")
        run_as = {launch.job_id: launch.run_as for launch in agent.launched}
        assert run_as == {a.id: "alice_ml", b.id: ""}


async def _has(agent, ids) -> bool:
    return ids <= {launch.job_id for launch in agent.launched}


def test_a_unix_user_in_the_tokens_file_must_be_a_user_name():
    ok = parse_tokens(f"- {{token_sha256: {hash_token('x')}, tenant: t, role: user, unix_user: ml-team}}\n")
    assert ok[hash_token("x")].unix_user == "ml-team"
    for bad in ("root user", "../x", "Bob", "-x"):
        with pytest.raises(ValueError, match="is not a Unix user name"):
            parse_tokens(f"- {{token_sha256: {hash_token('x')}, tenant: t, role: user, unix_user: '{bad}'}}\n")


async def test_a_node_token_acts_only_as_its_own_node(db_url, tmp_path):
    """node-1's credential cannot register, heartbeat, stream, ack or report as node-0; the refusal is logged
    (audit) and changes nothing. A node token that names no node acts as none."""
    async with AuthCluster(db_url, tmp_path, nodes=2) as c:
        admin, alice = c.clients["admin"], c.clients["alice"]
        job = await alice.submit("a", 1, 8, ["hang"])
        job = await alice.wait(job.id, ["RUNNING"], timeout=10)
        victim = job.allocations[0].node
        other = next(n for n in c.names if n != victim)
        before = {n.name: (n.state.value, n.last_heartbeat, n.address) for n in await admin.nodes()}
        logs = structlog.testing.capture_logs()
        audits = logs.__enter__()
        channel = open_aio_channel(c.address, token=f"tok-{other}")
        stub = agent_pb2_grpc.NodeServiceStub(channel)
        calls = {
            "RegisterNode": stub.RegisterNode(
                agent_pb2.RegisterNodeRequest(
                    node_name=victim, topology=c.agents[victim].topology(), address="10.6.6.6", agent_instance="evil"
                ),
                timeout=5,
            ),
            "Heartbeat": stub.Heartbeat(agent_pb2.HeartbeatRequest(node_name=victim), timeout=5),
            "AckAssignments": stub.AckAssignments(
                agent_pb2.AckAssignmentsRequest(node_name=victim, revision=10_000), timeout=5
            ),
            "ReportRankStatus": stub.ReportRankStatus(
                agent_pb2.ReportRankStatusRequest(
                    node_name=victim, job_id=job.id, attempt=1, rank=0, state=common_pb2.RANK_STATE_EXITED, exit_code=1
                ),
                timeout=5,
            ),
            "ReportAttemptReleased": stub.ReportAttemptReleased(
                agent_pb2.ReportAttemptReleasedRequest(node_name=victim, job_id=job.id, attempt=1), timeout=5
            ),
        }
        for method, call in calls.items():
            assert await _code(call) is grpc.StatusCode.PERMISSION_DENIED, method
        stream = stub.StreamAssignments(agent_pb2.StreamAssignmentsRequest(node_name=victim), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stream:
                pass
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert f"the credential of node {other!r} may not act as node {victim!r}" in err.value.details()
        await channel.close()
        # Nothing changed: the job still runs there, the node is as it was (its own agent's heartbeats go on).
        now = await alice.get_job(job.id)
        assert now.state.value == "RUNNING" and now.attempt == 1
        after = {n.name: (n.state.value, n.address) for n in await admin.nodes()}
        assert after == {k: (v[0], v[2]) for k, v in before.items()}
        logs.__exit__(None, None, None)
        audits = [a for a in audits if a["event"] == "audit"]
        denied = {a["method"].rsplit("/", 1)[-1] for a in audits if a.get("outcome") == "denied"}
        assert set(calls) | {"StreamAssignments"} <= denied
        assert all(a["tenant"] == "nodes" and a["role"] == "node" for a in audits)

        # A node token naming no node (a tokens file of before) acts as none, and says how to make one.
        write_tokens(c.tokens_path, [*TOKENS.values(), ("tok-anynode", "nodes", "node")])
        await eventually(lambda: holds(lambda: c.store.lookup("tok-anynode")), what="the file reloaded")
        channel = open_aio_channel(c.address, token="tok-anynode")
        stub = agent_pb2_grpc.NodeServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Heartbeat(agent_pb2.HeartbeatRequest(node_name=victim), timeout=5)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "phalanx token new --role node --node NAME" in err.value.details()
        await channel.close()


def test_token_new_makes_a_node_token_that_names_its_node(capsys):
    assert cli_main(["token", "new", "--tenant", "racks", "--role", "node"]) == 2
    assert "--node NAME" in capsys.readouterr().err
    assert cli_main(["token", "new", "--tenant", "racks", "--role", "user", "--node", "gpu-1"]) == 2
    capsys.readouterr()
    assert cli_main(["token", "new", "--tenant", "racks", "--role", "node", "--node", "gpu-1", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["entry"]["node"] == "gpu-1" and made["entry"]["role"] == "node"
    (ident,) = parse_tokens(f"- {json.dumps(made['entry'])}").values()
    assert (ident.role, ident.node) == ("node", "gpu-1")


async def test_priority_is_granted_by_the_queue_not_claimed(db_url, tmp_path, capsys, service_logs):
    """A user may ask for no more than its queue's max_priority (0, default, unless an admin raised it): above it
    is PERMISSION_DENIED with the cap, never lowered, and writes nothing. An admin's job has no cap."""
    async with AuthCluster(db_url, tmp_path, nodes=1) as c:
        admin, alice = c.clients["admin"], c.clients["alice"]
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(PermissionDeniedError) as err:
                await alice.submit("hi", 1, 1, ["run"], priority=100)
            assert "priority 100 (high) is above what queue 'default' grants: at most 0 (default)" in str(err.value)
            assert await admin.list_jobs() == []
            await admin.set_queue("research", None, max_priority=100)
        audits = [
            (a["outcome"], a["tenant"], a["role"], a["method"].rsplit("/", 1)[-1], a["object"])
            for a in logs
            if a["event"] == "audit"
        ]
        assert ("denied", "alice", "user", "SubmitJob", "queue/default") in audits
        assert ("done", "ops", "admin", "SetQueue", "queue/research") in audits
        ok = await alice.submit("hi", 1, 1, ["run"], priority=100, queue="research")
        assert ok.priority == 100
        with pytest.raises(PermissionDeniedError, match="at most 100 \\(high\\)"):
            await alice.submit("crit", 1, 1, ["run"], priority=200, queue="research")
        assert (await admin.submit("ops", 1, 1, ["run"], priority=200)).priority == 200
        assert {j.name for j in await admin.list_jobs()} == {"hi", "ops"}
        rc = await asyncio.to_thread(cli_main, ["--scheduler", c.address, "--token", "tok-admin", "queue"])
        assert rc == 0 and "priorities up to 100 (high)" in capsys.readouterr().out
        rc = await asyncio.to_thread(
            cli_main,
            [
                "--scheduler",
                c.address,
                "--token",
                "tok-admin",
                "quota",
                "set",
                "q2",
                "--max-priority",
                "batch",
                "--json",
            ],
        )
        assert rc == 0 and json.loads(capsys.readouterr().out)["max_priority"] == -100
