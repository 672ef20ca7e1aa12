"""Fuzzing the refusals (issues 20 and 31): every request message of the four services (the scheduler's Scheduler and
NodeService, the coordinator's CheckpointCoordinator, a node agent's AgentLogs), its fields drawn at random, sent by
a caller who must be refused whatever the request says; each refusal must carry the expected status and leave the
whole ledger (every table and column, test_authz_table._snapshot) exactly as it was. Real scheduler, coordinator
and AgentLogs servicer on one ledger (SQLite and PostgreSQL).

Every (method, caller) pair of CASES gets EXAMPLES derandomized examples (each request also carries a drawn unknown
field, so that even a request type with no fields gives that many distinct calls): 14 Scheduler methods x 3
callers, 6 NodeService methods x 3, 11 CheckpointCoordinator methods x 2 plus the methods with a job_id x 2, and
AgentLogs x 4 callers; the ledger is compared before and after each pair's examples (a still ledger before: the
agents hold their heartbeats, the scheduler keeps nothing pending)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.internal.encoder import _VarintBytes
from helpers.tokens import write_tokens
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_authz_table import ENTRIES, _quiet, _snapshot, ledger_diff, quiet_settings, serve_logs

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import agent_pb2_grpc, checkpoint_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client._channel import open_aio_channel, open_channel
from phalanx.common.tokens import TokenStore, node_logs_key, rank_token
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator.main import serve as serve_coordinator
from services.scheduler.main import serve

UNAUTH, DENIED, HIDDEN = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND
EXAMPLES = 10  # per (method, caller) pair
_SCALARS = {
    FieldDescriptor.TYPE_STRING: st.text(max_size=12),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: st.integers(0, 9),
}


@st.composite
def message(draw, cls, depth: int = 0, fixed: dict | None = None):
    """A `cls` message with a random subset of its fields set to random values (nested messages two deep)."""
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if fixed and field.name in fixed:
            setattr(msg, field.name, fixed[field.name])
            continue
        if not draw(st.booleans()):
            continue
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                key_field, value_field = (field.message_type.fields_by_name[k] for k in ("key", "value"))
                key = draw(_SCALARS.get(key_field.type, st.just(0)))
                if value_field.message_type is None:
                    getattr(msg, field.name)[key] = draw(_SCALARS.get(value_field.type, st.just(0)))
                elif depth < 2:  # a map of messages: the entry is made by reading it
                    entry = getattr(msg, field.name)[key]
                    entry.CopyFrom(draw(message(type(entry), depth + 1)))
            elif depth < 2:
                sub_cls = None if field.is_repeated else type(getattr(msg, field.name))
                if sub_cls is None:
                    getattr(msg, field.name).add().CopyFrom(
                        draw(message(type(getattr(msg, field.name).add()), depth + 1))
                    )
                else:
                    getattr(msg, field.name).CopyFrom(draw(message(sub_cls, depth + 1)))
            continue
        value = draw(_SCALARS.get(field.type, st.just(0)))
        if field.is_repeated:
            getattr(msg, field.name).append(value)
        else:
            setattr(msg, field.name, value)
    return msg


def _methods(service_descriptor, module):
    out = []
    for method in service_descriptor.methods:
        cls = getattr(module, method.input_type.name)
        out.append((method.name, cls, method.server_streaming))
    return out


@pytest.mark.timeout(600)
async def test_refused_requests_change_nothing_whatever_they_say(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    store = TokenStore(tokens)
    scheduler = await serve(quiet_settings(db_url), tokens=store)
    coordinator = await serve_coordinator(db_url, "127.0.0.1:0", tokens=store, sweep_interval=0)
    agents = [LiteAgent(scheduler.address, f"node-{i}", token=f"tok-node-{i}") for i in range(2)]
    for agent in agents:
        await agent.start()
    logs_server = None
    try:
        from phalanx.client import AsyncClient

        client = AsyncClient(scheduler.address, token="tok-alice", retries=0)
        job = await client.wait((await client.submit("mine", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        other = AsyncClient(scheduler.address, token="tok-bob", retries=0)
        theirs = await other.wait((await other.submit("theirs", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        async with open_aio_channel(scheduler.address, token="tok-bob") as channel:
            ask = scheduler_pb2.GetRankLogsRequest(job_id=theirs.id)
            bob_log = (await scheduler_pb2_grpc.SchedulerStub(channel).GetRankLogs(ask)).sources[0]
        await client.close()
        await other.close()
        engine = make_engine(db_url)
        with engine.begin() as conn:
            key = ensure_rank_key(conn)
        engine.dispose()
        logs_server, logs_addr = await serve_logs(tmp_path / "agent", node_logs_key(key, bob_log.node))
        for agent in agents:  # from here on the refused calls are the only callers
            agent.hold_heartbeats = True
        # The scheduler keeps the agents' last acks in memory until a cycle that writes, at most once a second:
        # an admin's write, a second on, takes them to the ledger before the fuzz starts from a still one.
        await asyncio.sleep(1.2)
        async with open_aio_channel(scheduler.address, token="tok-admin") as channel:
            queue = scheduler_pb2.QueueSpec(name="flush")
            await scheduler_pb2_grpc.SchedulerStub(channel).SetQueue(scheduler_pb2.SetQueueRequest(spec=queue))
        addresses = {"sched": scheduler.address, "coord": coordinator.address, "logs": logs_addr}
        counts = await asyncio.to_thread(
            _fuzz, addresses, db_url, job.id, rank_token(key, theirs.id, 1), bob_log.credential
        )
        assert len(counts) >= 14 * 3 + 6 * 3 + 11 * 2 + 4, sorted(counts)
        assert all(n >= EXAMPLES for n in counts.values()), {k: n for k, n in counts.items() if n < EXAMPLES}
    finally:
        if logs_server is not None:
            await logs_server.stop(0)
        for agent in agents:
            await agent.stop()
        await coordinator.stop(0)
        await scheduler.stop()


def _fuzz(addresses: dict[str, str], db_url: str, job_id: str, other_rank: str, bob_log: str) -> dict:
    """Every (method, caller) pair of the cases, EXAMPLES examples each; returns how many each pair ran."""
    channels = {}

    def stub(addr: str, token: str, kind):
        key = (addr, token)
        if key not in channels:
            channels[key] = open_channel(addr, token=token, retries=0)
        return kind(channels[key])

    from phalanx.api.v1 import agent_pb2, checkpoint_pb2

    sched = _methods(scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"], scheduler_pb2)
    nodes = _methods(agent_pb2.DESCRIPTOR.services_by_name["NodeService"], agent_pb2)
    ckpt = _methods(checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointCoordinator"], checkpoint_pb2)
    logs = _methods(agent_pb2.DESCRIPTOR.services_by_name["AgentLogs"], agent_pb2)
    S, N = scheduler_pb2_grpc.SchedulerStub, agent_pb2_grpc.NodeServiceStub
    C, L = checkpoint_pb2_grpc.CheckpointCoordinatorStub, agent_pb2_grpc.AgentLogsStub
    # (caller, service, stub class, methods, caller token, what is fixed in the request, the status it must get)
    cases = [
        ("no token", "sched", S, sched, "", {}, UNAUTH),
        ("node-0", "sched", S, sched, "tok-node-0", {}, DENIED),
        ("bob's rank", "sched", S, sched, other_rank, {}, DENIED),
        ("alice", "sched", N, nodes, "tok-alice", {}, DENIED),
        ("admin", "sched", N, nodes, "tok-admin", {}, DENIED),
        ("node-1 as node-0", "sched", N, nodes, "tok-node-1", {"node_name": "node-0"}, DENIED),
        ("no token", "coord", C, ckpt, "", {}, UNAUTH),
        ("node-0", "coord", C, ckpt, "tok-node-0", {}, DENIED),
        ("bob", "coord", C, ckpt, "tok-bob", {"job_id": job_id}, HIDDEN),
        ("bob's rank", "coord", C, ckpt, other_rank, {"job_id": job_id}, DENIED),
        ("no credential", "logs", L, logs, "tok-alice", {"credential": ""}, DENIED),
        ("bob's credential", "logs", L, logs, "tok-bob", {"credential": bob_log, "job_id": job_id}, DENIED),
        ("a rank token", "logs", L, logs, other_rank, {"credential": other_rank}, DENIED),
        ("anything", "logs", L, logs, "", {}, DENIED),  # a drawn credential: forged
    ]
    counts: dict[tuple[str, str], int] = {}
    before = _quiet(db_url)  # nothing the fuzz sends is allowed: the ledger must stay as it is now, to the end
    try:
        for caller, service, kind, methods, token, fixed, want in cases:
            for name, cls, streaming in methods:
                fields = {k: v for k, v in fixed.items() if k in cls.DESCRIPTOR.fields_by_name}
                if fixed and len(fields) < len(fixed):
                    continue  # a method without the fields that make the refusal: nothing to fuzz
                pair = (f"{kind.__name__[:-4]}.{name}", caller)
                counts[pair] = 0
                _fuzz_pair(stub(addresses[service], token, kind), name, cls, streaming, fields, want, pair, counts)
                after = _snapshot(db_url)
                assert after == before, (pair, ledger_diff(before, after))
    finally:
        for channel in channels.values():
            channel.close()
    return counts


def _fuzz_pair(stub, name, cls, streaming, fields, want, pair, counts) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure reports its request as it was drawn
    )
    @given(message(cls, fixed=fields), st.integers(0, 2**63))
    def run(request, noise) -> None:
        request.MergeFromString(_VarintBytes(9999 << 3) + _VarintBytes(noise))  # an unknown field: ignored
        counts[pair] += 1
        try:
            if streaming:
                for _ in getattr(stub, name)(request, timeout=2):
                    break
            else:
                getattr(stub, name)(request, timeout=5)
            raise AssertionError(f"{pair} was not refused: {request}")
        except grpc.RpcError as exc:
            assert exc.code() is want, (pair, exc.code(), exc.details(), request)

    run()


def test_the_message_strategy_fills_nested_fields():
    from hypothesis import find

    got = find(message(common_pb2.JobSpec), lambda m: bool(m.command) and m.replicas != 0 and bool(m.env))
    assert got.command and got.env
