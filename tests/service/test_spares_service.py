"""Spares kept in the domain through the scheduler service (LiteCluster, SQLite and PostgreSQL): a 2-segment gang
with 1 spare per segment on a two-domain NVLink fabric holds its spares idle in its segments' domains; when a node
of the gang is lost, the spare of that domain takes its replica in the same cycle and the gang restarts there (the
same rank order elsewhere, no requeue, no failure counted), while a pending gang that would fit never gets the slot;
the slot is booked as a spare again when the node comes back. Bad spares are INVALID_ARGUMENT, nothing written."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.two_domains import (
    NAMES,
    PENDING,
    RUNNING,
    agent,
    cluster,
    domain,
    nodes_of,
    report_fatal_gpu,
    running_attempt,
)
from helpers.waits import eventually, holds

from phalanx.api.v1 import common_pb2, scheduler_pb2


async def gang_with_spares(c: LiteCluster) -> common_pb2.Job:
    job = await c.submit("train", 4, 4, segment=2, spares_per_segment=1)
    assert job.spec.spares_per_segment == 1 and job.spec.segment == 2
    running = await c.wait_running(job.id)
    assert sorted(nodes_of(running)) == [0, 1, 2, 3]  # no rank on a spare: they are not allocations
    assert [(s.segment, s.booked) for s in running.spares] == [(0, True), (1, True)]
    for s in running.spares:
        assert domain(s.node) == s.domain == running.segment_domains[s.segment]
    assert len({*nodes_of(running).values(), *(s.node for s in running.spares)}) == 6
    for i in range(4):
        assert domain(nodes_of(running)[i]) == running.segment_domains[i // 2]
    return running


async def test_a_lost_node_is_swapped_for_the_spare_of_its_domain_and_the_slot_is_rebooked(db_url):
    async with cluster(db_url) as c:
        first = await gang_with_spares(c)
        shape = c.sql("SELECT shape FROM jobs WHERE id = :id", id=first.id)[0][0]
        assert "spares_per_segment" in str(shape) and "segment_tier" in str(shape)  # merged, not overwritten
        rows = c.sql(
            "SELECT replica FROM allocations WHERE job_id = :j AND released_at IS NULL AND replica < 0", j=first.id
        )
        assert sorted(r[0] for r in rows) == [-2, -2, -2, -2, -1, -1, -1, -1]  # 4 GPUs per spare, in the ledger
        spare_of = {s.segment: s.node for s in first.spares}
        for node in spare_of.values():  # held idle: nothing launched there
            assert not [x for x in agent(c, node).launched if x.job_id == first.id]
        waiter = await c.submit("waiter", 1, 4)  # would fit the dead node's slot, or a spare's
        await c.settled(first.id)

        dead = nodes_of(first)[2]  # segment 1
        await agent(c, dead).partition()

        async def swapped():
            job = await c.job(first.id)
            return job if job.attempt == 2 and job.state == RUNNING else None

        second = await eventually(swapped, what="the gang restarted on its spare")
        after = nodes_of(second)
        assert after[2] == spare_of[1] and domain(after[2]) == domain(dead)
        assert {r: n for r, n in after.items() if r != 2} == {r: n for r, n in nodes_of(first).items() if r != 2}
        assert second.failures == 0 and second.swaps == 1 and second.last_swap_at > 0
        assert f"{dead} -> {spare_of[1]}" in second.last_swap and "swapped in" in second.message
        assert [(s.segment, s.booked) for s in second.spares] == [(0, True), (1, False)]  # a missing spare
        assert (await c.job(waiter.id)).state == PENDING
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=first.id) == [
            ("NODE_LOST",)
        ]
        launched = [x for x in agent(c, spare_of[1]).launched if x.job_id == first.id]
        assert [(x.attempt, x.replica) for x in launched] == [(2, 2)]

        # The node comes back: its slot is booked as the segment's spare again, before the waiting gang gets it.
        await agent(c, dead).heal()

        async def rebooked():
            job = await c.job(first.id)
            return job if [(s.segment, s.node) for s in job.spares] == [(0, spare_of[0]), (1, dead)] else None

        third = await eventually(rebooked, what="the returned node booked as a spare")
        assert third.attempt == 2 and (await c.job(waiter.id)).state == PENDING
        assert not [x for x in agent(c, dead).launched if x.job_id == first.id and x.attempt == 2]

        # Cancelled, the gang gives back everything, its spares too, and the waiter runs.
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=first.id))
        await c.wait_running(waiter.id)
        held = "SELECT count(*) FROM allocations WHERE job_id = :j AND released_at IS NULL"
        assert c.sql(held, j=first.id) == [(0,)]


async def test_a_lost_spare_goes_missing_and_the_gang_runs_on_then_with_no_spare_left_it_requeues(db_url):
    async with cluster(db_url) as c:
        first = await gang_with_spares(c)
        await c.settled(first.id)
        spare_of = {s.segment: s.node for s in first.spares}
        await agent(c, spare_of[0]).partition()

        async def missing():
            job = await c.job(first.id)
            return job if [(s.segment, s.booked) for s in job.spares] == [(0, False), (1, True)] else None

        job = await eventually(missing, what="the lost spare missing", timeout=5)
        assert job.attempt == 1 and job.state == RUNNING  # the gang itself is not disturbed

        # Segment 0 has no spare left: losing one of its nodes is the teardown and requeue of before.
        await agent(c, nodes_of(first)[0]).partition()

        async def requeued():
            got = await c.job(first.id)
            return got if got.failures == 1 else None

        got = await eventually(requeued, what="the gang torn down and requeued")
        assert "was lost" in got.message and got.swaps == 0


async def test_a_draining_node_is_swapped_for_its_spare_at_once_and_a_draining_spare_goes_missing(db_url):
    # An agent stopping (SIGTERM: a rolling upgrade, a reboot) kills its ranks: the gang swaps the spare of that
    # domain in before the kills are reported, instead of being requeued as a failure.
    async with cluster(db_url) as c:
        first = await gang_with_spares(c)
        await c.settled(first.id)
        spare_of = {s.segment: s.node for s in first.spares}
        drained = nodes_of(first)[1]  # segment 0
        await agent(c, drained).drain()
        second = await eventually(lambda: running_attempt(c, first.id, 2), what="the spare swapped in for the drain")
        assert nodes_of(second)[1] == spare_of[0] and second.failures == 0 and second.swaps == 1
        assert "is draining" in second.message and "swapped in" in second.message
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=first.id) == [
            ("NODE_DRAINED",)
        ]
        # The other segment's spare drains: it goes missing, and the gang runs on undisturbed.
        await agent(c, spare_of[1]).drain()

        async def missing():
            job = await c.job(first.id)
            return job if [(s.segment, s.booked) for s in job.spares] == [(0, False), (1, False)] else None

        job = await eventually(missing, what="the drained spare missing")
        assert job.attempt == 2 and job.state == RUNNING


async def test_a_fatal_gpu_swaps_rank_0_onto_the_spare_and_goodput_counts_the_swap_as_restart(db_url):
    async with cluster(db_url) as c:
        first = await gang_with_spares(c)
        await c.settled(first.id)
        spare_of = {s.segment: s.node for s in first.spares}
        node, gpu = nodes_of(first)[0], first.allocations[0].gpus[1]
        waiter = await c.submit("waiter", 1, 3)  # fits the 3 healthy GPUs the failed node has left
        await report_fatal_gpu(c, node, gpu)
        second = await eventually(lambda: running_attempt(c, first.id, 2), what="rank 0 moved to its segment's spare")
        assert nodes_of(second)[0] == spare_of[0] and second.failures == 0
        assert f"GPU(s) [{gpu}] of {node} failed" in second.message
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=first.id) == [
            ("GPU_FAILED",)
        ]
        launch = next(x for x in agent(c, spare_of[0]).launched if x.job_id == first.id and x.attempt == 2)
        assert launch.replica == 0 and launch.env["MASTER_ADDR"] and launch.env["MASTER_PORT"]
        # The swap's own time, from the new attempt's reservation until its ranks run, is restart time.
        await c.settled(first.id)
        (reserved, running) = c.sql(
            "SELECT reserved_at, running_at FROM job_attempts WHERE job_id = :j AND attempt = 2", j=first.id
        )[0]
        assert reserved == pytest.approx(second.last_swap_at) and running is not None and running >= reserved

        async def counted():
            job = await c.job(first.id)
            return job if job.goodput.restart >= 16 * (running - reserved) else None

        await eventually(counted, what="goodput counting the swap as restart")
        # The failed node's 3 healthy GPUs hold no whole spare (4 GPUs) and stay free: the waiter, not the gang,
        # may take them (a spare is booked only where a whole replica fits).
        assert [(s.segment, s.booked) for s in (await c.job(first.id)).spares] == [(0, False), (1, True)]
        await c.wait_running(waiter.id)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(replicas=4, segment=2, spares_per_segment=-1), "spares_per_segment must be 0"),
        (dict(replicas=2, spares_per_segment=1), "spares_per_segment 1 needs segment"),
        (dict(replicas=4, segment=2, spares_per_segment=2), "too many spares: with 2 spare(s) per segment"),
        (
            dict(replicas=4, segment=2, spares_per_segment=1, min_replicas=1),
            "min_replicas 1 is not a multiple of segment 2",
        ),
    ],
)
async def test_bad_spares_are_invalid_argument_and_write_nothing(db_url, fields, words):
    async with cluster(db_url) as c:
        await eventually(
            lambda: holds(lambda: len(c.scheduler.service.state.nodes) == len(NAMES)), what="every node registered"
        )
        fields = dict(fields)
        replicas = fields.pop("replicas")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("bad", replicas, 4, **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 0
