"""EASY backfill through the scheduler service: a blocked head gets a reservation of whole leaves; a gang that ends
before it backfills, one without a time limit does not enter its leaf, and the head starts on time."""

from __future__ import annotations

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from helpers.waits import next_cycle

from phalanx.api.v1 import common_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING, SUCCEEDED = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED


def cluster(db_url: str, **settings) -> LiteCluster:
    names = [f"node-{i}" for i in range(8)]
    config = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names, nodes_per_leaf=4), **settings
    )
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


@pytest.mark.slow
async def test_short_gangs_backfill_long_ones_wait_and_the_head_starts_by_its_reservation(db_url):
    async with cluster(db_url) as c:
        a = await c.submit("a", 4, 8, ("sleep", "2.0"), time_limit_s=3.0)  # a whole leaf for <= 3 s
        b = await c.submit("b", 3, 8, ("sleep", "30"), time_limit_s=60.0)  # 3 nodes of the other leaf
        running_a = await c.wait_running(a.id)
        await c.wait_running(b.id)
        head = await c.submit("head", 4, 8, ("sleep", "0.2"), time_limit_s=10.0)  # needs a whole leaf
        short = await c.submit("short", 1, 8, ("sleep", "0.5"), time_limit_s=1.0)
        unlimited = await c.submit("unlimited", 1, 8, ("sleep", "0.2"))
        # Behind the pending head, the two are accepted (answered PENDING once written): a cycle after their replies
        # has adopted them and run the pass that decides them
        await next_cycle(c.scheduler.service)

        waiting = await c.job(head.id)
        assert waiting.state == PENDING and "It is next in line and starts by" in waiting.message, waiting.message
        assert (await c.job(short.id)).state in (RUNNING, SUCCEEDED)  # jumped the queue: it ends in time
        assert (await c.job(unlimited.id)).state == PENDING  # would outlive the reservation; the free node is taken

        started = await c.wait_running(head.id)
        assert started.started_at <= running_a.started_at + 3.0 + 1.0  # by a's limit, plus a scheduling tick
        assert {al.node for al in started.allocations} == {al.node for al in running_a.allocations}  # a's leaf
        later = await eventually(lambda: _started(c, unlimited.id), what="unlimited gang started")
        region = {al.node for al in running_a.allocations}
        # Outside the head's leaf (the node "short" freed), or inside it only after the head started. Read from
        # the ledger: a 0.2 s gang may be over already, and a job that is not RUNNING shows no allocations.
        (node,), *_ = c.sql(
            "SELECT n.name FROM allocations a JOIN nodes n ON n.id = a.node_id WHERE a.job_id = :j", j=unlimited.id
        )
        assert node not in region or later.started_at >= started.started_at


@pytest.mark.slow
async def test_strict_order_when_backfill_is_off(db_url):
    async with cluster(db_url, backfill=False) as c:
        a = await c.submit("a", 8, 8, ("sleep", "1.0"), time_limit_s=5.0)
        await c.wait_running(a.id)
        head = await c.submit("head", 8, 8, ("sleep", "0.1"))
        short = await c.submit("short", 1, 8, ("sleep", "0.1"), time_limit_s=1.0)
        first = await eventually(lambda: _started(c, head.id), what="head started")
        job = await c.job(short.id)
        assert job.state == PENDING or job.started_at >= first.started_at


async def _started(c, job_id):
    job = await c.job(job_id)
    return job if job.started_at > 0 else None
