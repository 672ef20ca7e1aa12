"""Decide at submit (issue 35 item 1), through a real scheduler and LiteAgents, on SQLite and PostgreSQL.

A batch of submits on a settled view is decided on its arrivals alone when they are strictly ahead of the pending
queue (services/scheduler/admission_lane.py); everything else goes to the pass. The path a batch took is counted
by the service (`admissions`, and phalanx_scheduler_admissions_total), so each test asserts which one decided."""

from __future__ import annotations

import asyncio
import uuid

from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_cycle

from phalanx.api.v1 import common_pb2
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.commands import Submit
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING


def cluster(db_url: str, nodes: int = 2, **settings) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names), **settings)
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


def counts(c: LiteCluster) -> dict[str, int]:
    return dict(c.scheduler.service.admissions)


async def settle(c: LiteCluster, *running: str) -> None:
    """Every rank of `running` reported, and a whole cycle after: no report or pass is owed when the next submit
    arrives (a report in the same batch would send it to a cycle, rightly)."""
    if running:
        await c.settled(*running)
    await next_cycle(c.scheduler.service)


async def test_a_submit_ahead_of_the_queue_is_decided_at_submit_and_one_behind_a_blocked_head_is_not(db_url):
    # Without the accept lane, which would answer the same-priority submission before any pass (test_accept_lane):
    # here the pass decides it in its own cycle, and the rule of the admission lane is what is asserted.
    async with cluster(db_url, accept_lane=False) as c:
        filler = await c.submit("filler", 1, 8, time_limit_s=600)
        await c.wait_running(filler.id)
        head = await c.submit("head", 2, 8)  # needs both nodes: blocked, with a reservation for when filler ends
        assert head.state == PENDING
        await settle(c, filler.id)
        before = counts(c)

        # Same priority as the head: the lane must not jump it. The pass decides by backfill rules, and a gang
        # without a time limit on the head's reserved node would delay it, so it waits.
        same = await c.submit("same", 1, 8)
        assert same.state == PENDING and (await c.job(head.id)).state == PENDING
        after_same = counts(c)
        assert after_same["pass"] == before["pass"] + 1 and after_same["lane"] == before["lane"]
        assert c.scheduler.service.lane_skips["no arrival is ahead of the pending queue"] >= 1
        await settle(c)

        # Strictly higher priority: decided at submit, the reply carries its placement (priorities win over the
        # head's reservation, as in the pass).
        higher = await c.submit("higher", 1, 8, priority=1)
        taken = {a.node for a in (await c.job(filler.id)).allocations}
        assert higher.state == RUNNING and [a.node for a in higher.allocations] == sorted({"node-0", "node-1"} - taken)
        after_higher = counts(c)
        assert after_higher["lane"] == after_same["lane"] + 1
        assert after_higher["admitted_at_submit"] == after_same["admitted_at_submit"] + 1
        assert (await c.job(same.id)).state == PENDING and (await c.job(head.id)).state == PENDING


async def test_a_submit_waits_for_the_pass_while_a_preemption_is_under_way(db_url):
    policy = PreemptionPolicy(min_runtime_s=0.0, grace_period_s=60.0)  # the victim is still checkpointing
    async with cluster(db_url, preemption=policy, preemption_poll_s=0.1) as c:
        low = await c.submit("low", 2, 8)
        await c.wait_running(low.id)
        await settle(c, low.id)
        high = await c.submit("high", 2, 8, priority=5)
        assert high.state == PENDING
        await eventually(lambda: _asked(c, low.id), what="the victim asked to checkpoint")
        await settle(c)
        before = counts(c)
        urgent = await c.submit("urgent", 1, 1, priority=10)  # ahead of the whole queue, but not alone
        assert urgent.state == PENDING
        after = counts(c)
        assert after["pass"] == before["pass"] + 1 and after["lane"] == before["lane"]
        # (why it went there is not asserted: besides the claim and the victim, the victim's checkpoint poll makes a
        # wake-up due every 0.1 s, and under load that is often the first reason the lane finds)


async def _asked(c: LiteCluster, job_id: str) -> bool:
    job = c.scheduler.service.state.jobs.get(job_id)
    return job is not None and bool(job.preempted_by)


async def test_concurrent_submits_ahead_of_the_queue_are_decided_in_one_transaction(db_url):
    async with cluster(db_url, nodes=2) as c:
        service = c.scheduler.service
        await settle(c)
        before = counts(c)
        generation = service._generation
        spec = common_pb2.JobSpec(replicas=1, gpus_per_replica=2, command=["run"], priority=3)
        # Queued in one turn of the event loop: the writer takes them as one batch (the group commit).
        replies = await asyncio.gather(
            *(service.execute(Submit(spec=spec, request_id=uuid.uuid4().hex)) for _ in range(6))
        )
        assert [r.state for r in replies] == [RUNNING] * 6
        assert sum(len(r.allocations) for r in replies) == 6
        after = counts(c)
        assert after["lane"] == before["lane"] + 1 and after["admitted_at_submit"] == before["admitted_at_submit"] + 6
        assert service._generation == generation + 1  # one commit for the six
        held = [(a.node, g) for r in replies for a in r.allocations for g in a.gpus]
        assert len(held) == len(set(held)) == 12  # no GPU given twice


async def test_a_batch_with_more_than_fits_reserves_the_prefix_and_the_pass_decides_the_rest(db_url):
    async with cluster(db_url, nodes=2) as c:
        service = c.scheduler.service
        await settle(c)
        big = common_pb2.JobSpec(replicas=1, gpus_per_replica=8, command=["run"], priority=2)
        replies = await asyncio.gather(
            *(service.execute(Submit(spec=big, request_id=uuid.uuid4().hex)) for _ in range(3))
        )
        # One submission time for the batch: the pass's order among them (priority, time, then id) is the lane's
        placed = [r for r in replies if r.state == RUNNING]
        (third,) = [r for r in replies if r.state == PENDING]
        assert sorted(r.allocations[0].node for r in placed) == ["node-0", "node-1"]
        assert "waiting" in third.message  # the pass, run in the same cycle for what the lane left, said why


async def test_a_write_by_another_replica_sends_the_next_submit_to_a_cycle_that_reads_it_first(db_url):
    """The lane decides only on a view no other writer changed since this replica's last commit: a follower's
    submit (PENDING, ahead in the queue) moves the generation, so the leader's next submit goes through a cycle
    that reads the follower's job first, and is not placed ahead of it."""
    from services.scheduler.main import serve

    leader = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", replica_id="a", poll_interval=60))
    await eventually(lambda: _value(leader.service.leading), what="replica a to lead")
    follower = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", replica_id="b", poll_interval=60))
    agent = LiteAgent(leader.address, "node-0")
    await agent.start()
    try:
        a, b = leader.service, follower.service
        await eventually(lambda: _value(a.state.capacity.free_gpus() == 8), what="the node READY")
        await next_cycle(a)
        before = dict(a.admissions)
        spec = common_pb2.JobSpec(replicas=1, gpus_per_replica=8, command=["run"], priority=7)
        first = await b.execute(Submit(spec=spec, request_id=uuid.uuid4().hex))  # the follower writes it PENDING
        assert first.state == PENDING
        second = await a.execute(Submit(spec=spec, request_id=uuid.uuid4().hex))
        assert a.admissions["pass"] == before["pass"] + 1 and a.admissions["lane"] == before["lane"]
        # (why: the generation moved, or, where a NOTIFY woke the leader to read the delta first, the follower's
        # job of the same priority is pending ahead of it: either way not alone)
        # The pass served the follower's job first (submitted first, same priority): it holds the node
        assert second.state == PENDING and a.state.jobs[first.id].state == "RUNNING"
    finally:
        await agent.stop()
        await follower.stop()
        await leader.stop()


async def _value(value):
    return value
