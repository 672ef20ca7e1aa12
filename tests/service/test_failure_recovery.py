"""Failure recovery through the scheduler service: a lost node or a fatal GPU tears the gang down whole; it
requeues with a backoff and a retry limit (preemptions do not count), and a node that comes back is not used
until it reports healthy, while the stale ranks it still runs are killed."""

from __future__ import annotations

import time

import grpc
import pytest
from helpers.clock import FakeClock
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_cycle

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING, FAILED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_FAILED


def cluster(db_url: str, nodes: int = 3, **settings) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    defaults = dict(lease_timeout=1.0, heartbeat_interval=0.2, retry_backoff_s=0.5, retry_backoff_max_s=5.0)
    config = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names), **{**defaults, **settings}
    )
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


async def attempt(c: LiteCluster, job_id: str, n: int, state: int = RUNNING) -> common_pb2.Job:
    async def check():
        job = await c.job(job_id)
        return job if job.attempt == n and job.state == state else None

    return await eventually(check, timeout=15, what=f"job {job_id} attempt {n} {common_pb2.JobState.Name(state)}")


def agent(c: LiteCluster, name: str) -> LiteAgent:
    return next(a for a in c.agents if a.name == name)


async def nodes(c: LiteCluster) -> dict[str, common_pb2.Node]:
    return {n.name: n for n in (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes}


@pytest.mark.slow
async def test_lost_node_requeues_after_a_backoff_and_its_stale_ranks_die_when_it_returns(db_url):
    async with cluster(db_url) as c:
        job = await c.submit("train", 2, 8)
        first = await c.wait_running(job.id)
        lost = first.allocations[0].node
        changes = c.changes()  # the requeue is seen from its change: it lasts only the 0.5 s backoff
        await agent(c, lost).partition()

        requeued = await changes.until(job.id, lambda j: j.attempt == 1 and j.state == PENDING, "the gang requeued")
        assert requeued.failures == 1 and requeued.not_before > 0 and "was lost" in requeued.message
        assert "backoff" in requeued.message
        second = await attempt(c, job.id, 2)
        assert second.started_at >= requeued.not_before - 0.01  # waited out its backoff
        assert lost not in {a.node for a in second.allocations}
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=job.id) == [("NODE_LOST",)]
        events = c.sql(
            "SELECT kind, severity FROM node_events e JOIN nodes n ON n.id = e.node_id WHERE n.name = :n", n=lost
        )
        assert ("LOST", "FATAL") in [tuple(r) for r in events]

        # The node comes back. Its ranks of attempt 1 are still "running" there: the queued kill stops them.
        back = agent(c, lost)
        assert (job.id, 1, 0) in back.running or (job.id, 1, 8) in back.running
        await back.heal()
        await eventually(lambda: _killed(back, job.id, 1), what="stale ranks killed")
        # Registered again, but not used until a heartbeat says it is healthy; then READY and free.
        healthy = await eventually(lambda: _healthy(c, lost), what="node healthy again")
        assert healthy.state == common_pb2.NODE_STATE_READY and healthy.free_gpus == 8
        assert (await c.job(job.id)).attempt == 2  # the job was not disturbed


@pytest.mark.slow
async def test_returning_node_is_not_used_before_its_first_health_report(db_url):
    clock = FakeClock()  # the scheduler's: a lease runs out when the test moves it, and not while it looks
    async with cluster(db_url, nodes=1, clock=clock.time) as c:
        only = c.agents[0]
        await only.partition()
        clock.advance(2 * c.settings.lease_timeout)
        await eventually(lambda: _state(c, only.name, common_pb2.NODE_STATE_LOST), what="LOST")
        only.hold_heartbeats = True  # back, registered, but no heartbeat yet, however long the test takes
        await only.heal()
        node = (await nodes(c))[only.name]
        assert node.state == common_pb2.NODE_STATE_READY and node.free_gpus == 0  # UNKNOWN health
        job = await c.submit("early", 1, 8)
        assert (await c.job(job.id)).state == PENDING  # its submission's pass found no healthy GPU
        only.hold_heartbeats = False
        await c.wait_running(job.id)  # after the first heartbeat


async def test_an_agent_declared_lost_while_alive_registers_again_when_its_heartbeat_says_so(db_url):
    """A scheduler that stalled past the lease declares a node lost whose agent never stopped beating; the agent's
    next heartbeat is answered `reregister`, and it registers again (the real agent, session.py, and the test
    agents alike), so the node does not stay lost while it is alive."""
    clock = FakeClock()
    async with cluster(db_url, nodes=1, clock=clock.time) as c:
        only = c.agents[0]
        only.hold_heartbeats = True  # silent in the scheduler's time only while the test moves its clock
        clock.advance(2 * c.settings.lease_timeout)
        await eventually(lambda: _state(c, only.name, common_pb2.NODE_STATE_LOST), what="LOST")
        assert only.registrations == 1
        only.hold_heartbeats = False
        await eventually(lambda: _state(c, only.name, common_pb2.NODE_STATE_READY), what="READY again")
        assert only.registrations == 2
        job = await c.submit("after", 1, 8)
        await c.wait_running(job.id)


@pytest.mark.slow
async def test_failures_stop_at_the_retry_limit_but_preemptions_do_not_count(db_url):
    async with cluster(
        db_url,
        nodes=2,
        max_attempts=2,
        retry_backoff_s=0.1,
        preemption=PreemptionPolicy(min_runtime_s=0, grace_period_s=0),
        preemption_poll_s=0.1,
    ) as c:
        low = await c.submit("low", 1, 8, priority=0)
        await c.wait_running(low.id)
        for i in range(3):  # preempted three times: never FAILED for it
            high = await c.submit(f"high-{i}", 2, 8, priority=10)
            await c.wait_running(high.id)
            await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=high.id))
            await attempt(c, low.id, i + 2)
        job = await c.job(low.id)
        assert job.preemptions == 3 and job.failures == 0

        # Two node losses: the second reaches the limit.
        for n in (1, 2):
            running = await c.job(low.id)
            node = running.allocations[0].node
            await agent(c, node).partition()
            if n == 1:
                await attempt(c, low.id, running.attempt + 1)
                await agent(c, node).heal()
        failed = await attempt(c, low.id, running.attempt, FAILED)
        assert failed.failures == 2 and "gave up after 2 failed attempts" in failed.message


async def test_fatal_gpu_tears_down_only_the_gangs_on_it_and_they_restart_elsewhere(db_url):
    async with cluster(db_url, nodes=3, lease_timeout=30.0) as c:
        big = await c.submit("big", 2, 8)
        small = await c.submit("small", 1, 4)
        big_run, small_run = await c.wait_running(big.id), await c.wait_running(small.id)
        node = big_run.allocations[0].node
        gpu = big_run.allocations[0].gpus[3]
        assert node not in {a.node for a in small_run.allocations}
        async with grpc.aio.insecure_channel(c.scheduler.address) as ch:
            stub = agent_pb2_grpc.NodeServiceStub(ch)
            health = common_pb2.NodeHealth(
                state=common_pb2.HEALTH_STATE_DEGRADED,
                reason=f"GPU {gpu}: XID 79",
                gpus=[common_pb2.GpuHealth(index=gpu, state=common_pb2.HEALTH_STATE_FATAL, reasons=["XID 79"])],
            )
            changes = c.changes()  # the requeue is seen from its change: it lasts only the 0.5 s backoff
            await stub.Heartbeat(agent_pb2.HeartbeatRequest(node_name=node, health=health))
        requeued = await changes.until(big.id, lambda j: j.attempt == 1 and j.state == PENDING, "the big gang requeued")
        assert requeued.failures == 1 and f"GPU(s) [{gpu}] of {node} failed" in requeued.message
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j", j=big.id) == [("GPU_FAILED",)]
        assert (await c.job(small.id)).attempt == 1 and (await c.job(small.id)).state == RUNNING
        shown = (await nodes(c))[node]
        assert shown.free_gpus == 7  # the failed GPU stays out


async def test_a_scheduler_that_stalls_past_the_lease_loses_no_node(db_url):
    """The scheduler's process stops for longer than the lease (paused, starved of CPU, a blocking call on its event
    loop): the heartbeats it could not hear meanwhile do not count against the nodes. (This test's agents run in the
    scheduler's process, so they stall too: a blocking sleep on the loop stops all of them alike.)"""
    async with cluster(db_url, nodes=2) as c:
        job = await c.submit("steady", 2, 8)
        await c.wait_running(job.id)
        service = c.scheduler.service
        time.sleep(2.5 * c.settings.lease_timeout)  # the whole process stalls: no heartbeat is sent or heard
        await next_cycle(service)  # the first cycle after the stall: its timers judged every lease
        assert service.intake.stalls.credited > 2 * c.settings.lease_timeout  # it saw the stall
        assert {n.name: n.state for n in (await nodes(c)).values()} == {
            "node-0": common_pb2.NODE_STATE_READY,
            "node-1": common_pb2.NODE_STATE_READY,
        }
        same = await c.job(job.id)
        assert same.state == RUNNING and same.attempt == 1 and same.failures == 0
        # A node that really stops heartbeating is still lost after the lease.
        await agent(c, "node-1").partition()
        await eventually(lambda: _state(c, "node-1", common_pb2.NODE_STATE_LOST), what="node-1 LOST")
        assert (await nodes(c))["node-0"].state == common_pb2.NODE_STATE_READY


async def _killed(a: LiteAgent, job_id: str, attempt: int) -> bool:
    return any(k.job_id == job_id and k.attempt == attempt for k in a.killed) and not any(
        key[:2] == (job_id, attempt) and not t.done() for key, t in a.running.items()
    )


async def _healthy(c: LiteCluster, name: str):
    node = (await nodes(c))[name]
    return node if node.health.state == common_pb2.HEALTH_STATE_HEALTHY and node.free_gpus == 8 else None


async def _state(c: LiteCluster, name: str, state: int):
    return (await nodes(c))[name].state == state


@pytest.mark.slow
async def test_rank_failure_restarts_the_gang_up_to_max_restarts_then_fails(db_url):
    async with cluster(db_url, nodes=2, retry_backoff_s=0.1) as c:
        job = await c.submit("flaky", 2, 8, ("exit", "3"), max_restarts=2)
        failed = await attempt(c, job.id, 3, FAILED)
        assert failed.failures == 2 and failed.exit_code == 3 and "after 2 restart(s)" in failed.message
        rows = c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j ORDER BY attempt", j=job.id)
        assert [r[0] for r in rows] == ["RANK_FAILED", "RANK_FAILED", "FAILED"]
        no_restarts = await c.submit("strict", 1, 8, ("exit", "4"))
        strict = await attempt(c, no_restarts.id, 1, FAILED)
        assert strict.failures == 0 and "exited with code 4" in strict.message


async def test_max_restarts_out_of_range_is_refused(db_url):
    async with cluster(db_url, nodes=1) as c:
        for bad in (-1, 1001):
            try:
                await c.submit("bad", 1, 8, max_restarts=bad)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_restarts" in exc.details()
            else:
                raise AssertionError(f"max_restarts={bad} was accepted")
        assert c.sql("SELECT count(*) FROM jobs") == [(0,)]


async def test_a_gang_is_stopped_at_its_time_limit(db_url):
    async with cluster(db_url, nodes=1) as c:
        job = await c.submit("bounded", 1, 8, time_limit_s=0.8)
        running = await c.wait_running(job.id)
        assert running.spec.time_limit_s == 0.8
        done = await attempt(c, job.id, 1, FAILED)
        assert "time limit of 0.8s" in done.message and done.finished_at - done.started_at >= 0.8
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j", j=job.id) == [("TIMEOUT",)]
        bad = [-1.0, float("nan"), 1e12]
        for value in bad:
            try:
                await c.submit("bad", 1, 8, time_limit_s=value)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "time_limit_s" in exc.details()
            else:
                raise AssertionError(f"time_limit_s={value} was accepted")
