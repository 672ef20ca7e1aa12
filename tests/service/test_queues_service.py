"""Queues through the scheduler service: quotas with cohort borrowing, reclaim by preemption, quota refusals that
do not block other queues, and `ListQueues` with positions."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING


def cluster(db_url: str, nodes: int = 2) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    config = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(names),
        preemption=PreemptionPolicy(min_runtime_s=0, grace_period_s=0),
        preemption_poll_s=0.1,
    )
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


def queue(name, gpus, cohort="", borrow_limit=None, weight=1.0, flavor="*", tenants=()):
    spec = scheduler_pb2.QueueSpec(name=name, cohort=cohort, weight=weight, tenants=list(tenants))
    spec.quotas.add(flavor=flavor, gpus=gpus, has_borrow_limit=borrow_limit is not None, borrow_limit=borrow_limit or 0)
    return scheduler_pb2.SetQueueRequest(spec=spec)


async def test_borrowing_then_reclaim_by_preemption(db_url):
    async with cluster(db_url) as c:
        await c.stub.SetQueue(queue("research", 8, cohort="lab"))
        status = await c.stub.SetQueue(queue("prod", 8, cohort="lab"))
        assert status.spec.name == "prod" and status.spec.quotas[0].gpus == 8
        first = await c.submit("r1", 1, 8, queue="research")
        second = await c.submit("r2", 1, 8, queue="research")  # beyond nominal: borrows prod's idle quota
        await c.wait_running(first.id)
        await c.wait_running(second.id)
        (research,) = (await c.stub.ListQueues(scheduler_pb2.ListQueuesRequest(name="research"))).queues
        assert research.running == 2 and research.usage[0].gpus == 16 and research.usage[0].borrowing
        third = await c.submit("r3", 1, 8, queue="research")  # nothing left to borrow
        waiting = await c.job(third.id)
        assert waiting.state == PENDING and "waiting for quota" in waiting.message

        owner = await c.submit("p1", 1, 8, queue="prod")  # within prod's nominal: reclaims
        await c.wait_running(owner.id)
        states = {j.id: (await c.job(j.id)) for j in (first, second)}
        reclaimed = [j for j in states.values() if j.state == PENDING]
        assert len(reclaimed) == 1 and reclaimed[0].preemptions == 1
        assert (
            "reclaims the quota" in c.sql("SELECT reason FROM job_attempts WHERE job_id = :j", j=reclaimed[0].id)[0][0]
        )
        assert (await c.job(owner.id)).flavor == "*"


async def test_quota_refusal_does_not_block_other_queues_and_positions_are_shown(db_url):
    async with cluster(db_url) as c:
        await c.stub.SetQueue(queue("small", 8))
        await c.stub.SetQueue(queue("big", 16))
        a = await c.submit("a", 1, 8, queue="small")
        await c.wait_running(a.id)
        over = await c.submit("over", 1, 8, queue="small")  # over small's quota, no cohort
        other = await c.submit("other", 1, 8, queue="big")  # another queue goes on
        await c.wait_running(other.id)
        assert (await c.job(over.id)).state == PENDING
        listing = {q.spec.name: q for q in (await c.stub.ListQueues(scheduler_pb2.ListQueuesRequest())).queues}
        assert set(listing) >= {"small", "big", "default"}
        assert [(p.job_id, p.position) for p in listing["small"].pending] == [(over.id, 1)]
        assert "no cohort" in listing["small"].pending[0].message


async def test_queue_validation_and_unknown_queues(db_url):
    async with cluster(db_url, nodes=1) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("x", 1, 8, queue="nope")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no queue 'nope'" in err.value.details()
        for bad in (queue("", 8), queue("a b", 8), queue("q", -1), queue("q", 8, weight=-2)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.SetQueue(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.sql("SELECT count(*) FROM queues") == [(0,)]
        await c.stub.SetQueue(queue("q", 8))
        job = await c.submit("y", 1, 8, queue="q")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.DeleteQueue(scheduler_pb2.DeleteQueueRequest(name="q"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        await c.stub.DeleteQueue(scheduler_pb2.DeleteQueueRequest(name="q"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.ListQueues(scheduler_pb2.ListQueuesRequest(name="q"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
async def test_a_reclaimed_gang_that_would_borrow_does_not_preempt_the_reclaimer(db_url):
    # Kueue's borrowWithinCohort "Never": a high-priority gang that could only run on borrowed quota may preempt
    # within its own queue, not the gang that reclaimed that quota (else the two would evict each other forever).
    async with cluster(db_url) as c:
        await c.stub.SetQueue(queue("research", 8, cohort="lab"))
        await c.stub.SetQueue(queue("prod", 8, cohort="lab"))
        await c.stub.SetQueue(queue("spare", 8, cohort="lab"))  # idle quota (no GPUs behind it) to borrow from
        first = await c.submit("r1", 1, 8, queue="research", priority=100)
        second = await c.submit("r2", 1, 8, queue="research", priority=100)  # borrows prod's idle quota
        await c.wait_running(first.id)
        await c.wait_running(second.id)
        owner = await c.submit("p1", 1, 8, queue="prod")  # priority 0, within nominal: reclaims anyway
        await c.wait_running(owner.id)
        # No minimum runtime, no grace: a thrash would show in the passes that follow the reclaim, once the evicted
        # gang's ranks are gone (no GPU releasing) and the owner's run.
        await eventually(lambda: _nothing_releasing(c), what="the evicted gang's GPUs released")
        await c.settled(owner.id)
        assert (await c.job(owner.id)).state == RUNNING and (await c.job(owner.id)).preemptions == 0
        jobs = [await c.job(j.id) for j in (first, second)]
        assert sorted(j.state for j in jobs) == sorted([RUNNING, PENDING])
        assert sum(j.preemptions for j in jobs) == 1
        reclaimed = next(j for j in jobs if j.state == PENDING)
        assert "waiting" in reclaimed.message and reclaimed.preemptions == 1


async def _nothing_releasing(c: LiteCluster) -> bool:
    nodes = (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
    return not any(n.releasing_gpus for n in nodes)
