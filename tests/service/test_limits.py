"""No caller exhausts the scheduler (issue 20, item 6): a bounded buffer per watch stream (a slow watcher is ended,
memory stays bounded), a cap on each tenant's open watch streams, and limits on message size and job specs, each
with its flag. Real scheduler, real gRPC, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers.procs import eventually
from helpers.tokens import write_tokens

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.common.tokens import TokenStore
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings


def _spec(name: str, **kw) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=1, command=["hang"], **kw)


async def _started(db_url: str, tmp_path, **limits):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(
        tokens,
        [("tok-alice", "alice", "user", ""), ("tok-bob", "bob", "user", ""), ("tok-node", "nodes", "node", "node-0")],
    )
    scheduler = await serve(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"]), **limits),
        tokens=TokenStore(tokens),
    )
    agent = LiteAgent(scheduler.address, "node-0", token="tok-node")
    await agent.start()
    return scheduler, agent


def _stub(address: str, token: str) -> tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerStub]:
    from phalanx.client._channel import open_aio_channel

    channel = open_aio_channel(address, token=token)
    return channel, scheduler_pb2_grpc.SchedulerStub(channel)


async def test_a_slow_watcher_is_ended_and_its_buffer_stays_bounded(db_url, tmp_path):
    scheduler, agent = await _started(db_url, tmp_path, watch_queue=5)
    channel, alice = _stub(scheduler.address, "tok-alice")
    try:
        watch = alice.WatchJobs(scheduler_pb2.WatchJobsRequest())
        fanout = scheduler.service.fanout
        await eventually(lambda: asyncio.sleep(0, fanout.watched), what="the watcher subscribed")
        (watcher,) = fanout._watchers
        # Twenty submissions in one go: a burst of changes the watcher, which reads nothing, cannot keep up with.
        await asyncio.gather(*(alice.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec(f"j{i}"))) for i in range(20)))
        assert watcher.overflowed and len(watcher.items) == 0  # its buffer dropped, not grown
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in watch:
                assert len(watcher.items) <= 5
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fell more than 5 changes behind (--watch-queue)" in err.value.details()
        assert not fanout.watched  # unsubscribed: nothing of it is kept
    finally:
        await channel.close()
        await agent.stop()
        await scheduler.stop()


async def test_a_tenant_holds_at_most_max_watches_streams(db_url, tmp_path):
    scheduler, agent = await _started(db_url, tmp_path, max_watches=2)
    channel, alice = _stub(scheduler.address, "tok-alice")
    other, bob = _stub(scheduler.address, "tok-bob")
    try:
        streams = [alice.WatchJobs(scheduler_pb2.WatchJobsRequest()) for _ in range(2)]
        await eventually(lambda: asyncio.sleep(0, len(scheduler.service.fanout._watchers) == 2), what="two watchers")
        third = alice.WatchJobs(scheduler_pb2.WatchJobsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in third:
                pass
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'alice' has 2 WatchJobs streams open, the limit (--max-watches)" in err.value.details()
        bobs = bob.WatchJobs(scheduler_pb2.WatchJobsRequest())  # another tenant is not held to alice's count
        await eventually(lambda: asyncio.sleep(0, len(scheduler.service.fanout._watchers) == 3), what="bob's watcher")
        streams[0].cancel()
        await eventually(lambda: asyncio.sleep(0, len(scheduler.service.fanout._watchers) == 2), what="one closed")
        again = alice.WatchJobs(scheduler_pb2.WatchJobsRequest())
        await eventually(lambda: asyncio.sleep(0, len(scheduler.service.fanout._watchers) == 3), what="a new one")
        for s in (streams[1], bobs, again):
            s.cancel()
    finally:
        await channel.close()
        await other.close()
        await agent.stop()
        await scheduler.stop()


async def test_spec_and_message_limits_have_flags_and_refuse_with_the_flag_named(db_url, tmp_path):
    scheduler, agent = await _started(
        db_url, tmp_path, max_replicas=4, max_env_vars=2, max_env_bytes=100, max_command_bytes=50,
        max_message_bytes=64 * 1024,
    )  # fmt: skip
    channel, alice = _stub(scheduler.address, "tok-alice")
    try:
        cases = {
            "--max-replicas": common_pb2.JobSpec(name="r", replicas=5, gpus_per_replica=1, command=["hang"]),
            "--max-env-vars": _spec("e", env={"A": "1", "B": "2", "C": "3"}),
            "--max-env-bytes": _spec("e", env={"A": "x" * 200}),
            "--max-command-bytes": common_pb2.JobSpec(name="c", replicas=1, gpus_per_replica=1, command=["x" * 60]),
        }
        for flag, spec in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and flag in err.value.details(), flag
        with pytest.raises(grpc.aio.AioRpcError) as err:  # over --max-message-bytes: refused before it is read
            await alice.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=_spec("big", env={"A": "x" * 100_000})))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        jobs = await alice.ListJobs(scheduler_pb2.ListJobsRequest())
        assert list(jobs.jobs) == []
    finally:
        await channel.close()
        await agent.stop()
        await scheduler.stop()
