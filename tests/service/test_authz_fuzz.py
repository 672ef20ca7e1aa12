"""Fuzzing the refusals (issue 20): every request message of the three services, its fields drawn at random, sent
by a caller who must be refused whatever the request says; each refusal must carry the expected status and leave
the ledger exactly as it was. Real scheduler and coordinator on one ledger (SQLite and PostgreSQL); examples are
bounded and derandomized."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.descriptor import FieldDescriptor
from helpers.tokens import write_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_authz_table import ENTRIES, _snapshot

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import agent_pb2_grpc, checkpoint_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.client._channel import open_channel
from phalanx.common.tokens import TokenStore, rank_token
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator.main import serve as serve_coordinator
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

UNAUTH, DENIED, HIDDEN = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND
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
                key = draw(st.text(min_size=1, max_size=8))
                getattr(msg, field.name)[key] = draw(st.text(max_size=8))
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


async def test_refused_requests_change_nothing_whatever_they_say(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    store = TokenStore(tokens)
    scheduler = await serve(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0", "node-1"])),
        tokens=store,
    )
    coordinator = await serve_coordinator(db_url, "127.0.0.1:0", tokens=store, sweep_interval=0)
    agents = [LiteAgent(scheduler.address, f"node-{i}", token=f"tok-node-{i}") for i in range(2)]
    for agent in agents:
        await agent.start()
    try:
        alice = scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(scheduler.address))
        from phalanx.client import AsyncClient

        client = AsyncClient(scheduler.address, token="tok-alice", retries=0)
        job = await client.wait((await client.submit("mine", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        other = AsyncClient(scheduler.address, token="tok-bob", retries=0)
        theirs = await other.wait((await other.submit("theirs", 1, 1, ["hang"])).id, ["RUNNING"], timeout=10)
        await client.close()
        await other.close()
        del alice
        engine = make_engine(db_url)
        with engine.begin() as conn:
            key = ensure_rank_key(conn)
        engine.dispose()
        await asyncio.to_thread(
            _fuzz, scheduler.address, coordinator.address, db_url, job.id, rank_token(key, theirs.id, 1)
        )
    finally:
        for agent in agents:
            await agent.stop()
        await coordinator.stop(0)
        await scheduler.stop()


def _fuzz(sched_addr: str, coord_addr: str, db_url: str, job_id: str, other_rank: str) -> None:
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
    # (address, stub class, methods, caller token, what is fixed in the request, the status it must get)
    cases = [
        (sched_addr, scheduler_pb2_grpc.SchedulerStub, sched, "", {}, UNAUTH),
        (sched_addr, scheduler_pb2_grpc.SchedulerStub, sched, "tok-node-0", {}, DENIED),
        (sched_addr, scheduler_pb2_grpc.SchedulerStub, sched, other_rank, {}, DENIED),
        (sched_addr, agent_pb2_grpc.NodeServiceStub, nodes, "tok-alice", {}, DENIED),
        (sched_addr, agent_pb2_grpc.NodeServiceStub, nodes, "tok-admin", {}, DENIED),
        (sched_addr, agent_pb2_grpc.NodeServiceStub, nodes, "tok-node-1", {"node_name": "node-0"}, DENIED),
        (coord_addr, checkpoint_pb2_grpc.CheckpointCoordinatorStub, ckpt, "", {}, UNAUTH),
        (coord_addr, checkpoint_pb2_grpc.CheckpointCoordinatorStub, ckpt, "tok-node-0", {}, DENIED),
        (coord_addr, checkpoint_pb2_grpc.CheckpointCoordinatorStub, ckpt, "tok-bob", {"job_id": job_id}, HIDDEN),
        (coord_addr, checkpoint_pb2_grpc.CheckpointCoordinatorStub, ckpt, other_rank, {"job_id": job_id}, DENIED),
    ]

    @st.composite
    def calls(draw):
        addr, kind, methods, token, fixed, want = draw(st.sampled_from(cases))
        name, cls, streaming = draw(st.sampled_from(methods))
        fields = {k: v for k, v in fixed.items() if k in cls.DESCRIPTOR.fields_by_name}
        if fixed and not fields:
            return None  # a method without the field that makes the refusal: nothing to fuzz
        return addr, kind, name, draw(message(cls, fixed=fields)), streaming, token, want

    @settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(calls())
    def run(call) -> None:
        if call is None:
            return
        addr, kind, name, request, streaming, token, want = call
        before = _snapshot(db_url)
        try:
            if streaming:
                for _ in getattr(stub(addr, token, kind), name)(request, timeout=2):
                    break
            else:
                getattr(stub(addr, token, kind), name)(request, timeout=5)
            raise AssertionError(f"{name} by {token[:12]!r} was not refused: {request}")
        except grpc.RpcError as exc:
            assert exc.code() is want, (name, token[:12], exc.code(), exc.details(), request)
        assert _snapshot(db_url) == before, (name, token[:12], request)

    try:
        run()
    finally:
        for channel in channels.values():
            channel.close()


def test_the_message_strategy_fills_nested_fields():
    from hypothesis import find

    got = find(message(common_pb2.JobSpec), lambda m: bool(m.command) and m.replicas != 0 and bool(m.env))
    assert got.command and got.env
