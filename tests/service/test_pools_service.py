"""The operator's spare pools through the scheduler service (LiteCluster, SQLite and PostgreSQL), on a two-domain
NVLink fabric (2 x 3 nodes of 4 GPUs) with a pool of 1 node per domain: the pool books an idle node per domain;
a job without a time limit never lands there; a gang that loses a node (and has no spare of its own) gets the pool
node of that domain, in one swap, restarting from its checkpoint without requeue; a time-limited backfill job
borrowing that node is preempted at once, with no checkpoint handshake; bad input is refused and nothing written."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.two_domains import PENDING, RUNNING, agent, cluster, domain, nodes_of, report_fatal_gpu, running_attempt
from helpers.waits import eventually

from phalanx.api.v1 import scheduler_pb2
from phalanx.core.spare_invariants import pool_violations


async def pool_with_one_per_domain(c: LiteCluster) -> dict[str, str]:
    """A pool of 1 node per NVLink domain: domain -> its booked node, once both are booked."""
    made = await c.stub.CreatePool(scheduler_pb2.CreatePoolRequest(name="spare", tier="nvlink", per_domain=1))
    assert made.name == "spare" and made.tier == "nvlink" and made.per_domain == 1

    async def booked():
        (pool,) = (await c.stub.ListPools(scheduler_pb2.ListPoolsRequest())).pools
        got = {d.domain: list(d.booked) for d in pool.domains}
        return got if len(got) == 2 and all(len(n) == 1 for n in got.values()) else None

    got = await eventually(booked, what="a node booked per domain")
    for d, (node,) in got.items():
        assert domain(node) == d
    return {d: n[0] for d, n in got.items()}


def invariant_holds(c: LiteCluster) -> None:
    state = c.scheduler.service.state
    jobs = [(j.id, j.time_limit, j.nodes) for j in state.jobs.in_state("RUNNING").values()]
    assert pool_violations(state.pools.values(), jobs) == []


async def test_pool_create_list_delete_and_bad_input_writes_nothing(db_url):
    async with cluster(db_url) as c:
        booked = await pool_with_one_per_domain(c)
        rows = "SELECT name, tier, per_domain, booked FROM spare_pools ORDER BY name"
        before = c.sql(rows)
        assert len(before) == 1 and before[0][:3] == ("spare", "nvlink", 1)
        bad = [
            (scheduler_pb2.CreatePoolRequest(name="x", tier="rack", per_domain=1), "unknown tier 'rack'"),
            (scheduler_pb2.CreatePoolRequest(name="x", tier="nvlink", per_domain=0), "at least 1"),
            (scheduler_pb2.CreatePoolRequest(name="x", tier="nvlink", per_domain=4), "more than any domain"),
            (scheduler_pb2.CreatePoolRequest(name="bad name", tier="nvlink", per_domain=1), "pool name"),
        ]
        for request, why in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.CreatePool(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.CreatePool(scheduler_pb2.CreatePoolRequest(name="spare", tier="leaf", per_domain=1))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert c.sql(rows) == before
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.DeletePool(scheduler_pb2.DeletePoolRequest(name="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.ListPools(scheduler_pb2.ListPoolsRequest(name="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        # A job without a time limit never takes a pool node, even when nothing else is free.
        gang = await c.submit("gang", 4, 4)
        running = await c.wait_running(gang.id)
        assert not set(nodes_of(running).values()) & set(booked.values())
        waiter = await c.submit("waiter", 1, 4)
        await c.settled(gang.id)
        assert (await c.job(waiter.id)).state == PENDING
        invariant_holds(c)

        # Deleted, the pool's nodes go back to normal work.
        await c.stub.DeletePool(scheduler_pb2.DeletePoolRequest(name="spare"))
        assert c.sql(rows) == []
        assert (await c.stub.ListPools(scheduler_pb2.ListPoolsRequest())).pools == []
        assert nodes_of(await c.wait_running(waiter.id))[0] in booked.values()


async def test_a_gang_that_loses_a_node_gets_the_pool_node_of_its_domain(db_url):
    async with cluster(db_url) as c:
        booked = await pool_with_one_per_domain(c)
        first = await c.wait_running((await c.submit("train", 4, 4)).id)
        waiter = await c.submit("waiter", 1, 4)  # no time limit: never on a pool node
        await c.settled(first.id)
        dead = nodes_of(first)[1]
        spare = booked[domain(dead)]
        await agent(c, dead).partition()

        async def swapped():
            job = await c.job(first.id)
            return job if job.attempt == 2 and job.state == RUNNING else None

        second = await eventually(swapped, what="the gang restarted on the pool node")
        after = nodes_of(second)
        assert after[1] == spare and domain(after[1]) == domain(dead)
        assert {r: n for r, n in after.items() if r != 1} == {r: n for r, n in nodes_of(first).items() if r != 1}
        assert second.failures == 0 and second.swaps == 1
        assert f"{dead} -> {spare} (pool spare, {domain(dead)})" == second.last_swap
        assert "node of spare pool spare" in second.message
        assert (await c.job(waiter.id)).state == PENDING
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=first.id) == [
            ("NODE_LOST",)
        ]
        held = "SELECT count(*) FROM allocations WHERE job_id = :j AND attempt = 2 AND released_at IS NULL"
        assert c.sql(held, j=first.id) == [(16,)]
        (pool,) = (await c.stub.ListPools(scheduler_pb2.ListPoolsRequest())).pools
        missing = {d.domain: d.missing for d in pool.domains}
        other = next(d for d in booked if d != domain(dead))
        assert missing == {domain(dead): 1, other: 0}  # no idle node left in the dead node's domain
        invariant_holds(c)

        # The dead node returns: the pool books it, before the waiting job (no time limit) could take it.
        await agent(c, dead).heal()

        async def rebooked():
            (p,) = (await c.stub.ListPools(scheduler_pb2.ListPoolsRequest())).pools
            return p if all(d.missing == 0 for d in p.domains) else None

        pool = await eventually(rebooked, what="the returned node booked in the pool")
        assert {d.domain: list(d.booked) for d in pool.domains}[domain(dead)] == [dead]
        assert (await c.job(waiter.id)).state == PENDING
        invariant_holds(c)


async def test_a_time_limited_borrower_is_preempted_at_once_when_a_swap_needs_its_node(db_url):
    async with cluster(db_url) as c:
        booked = await pool_with_one_per_domain(c)
        gang = await c.wait_running((await c.submit("train", 4, 4)).id)
        borrower = await c.wait_running((await c.submit("backfill", 1, 4, time_limit_s=3600)).id)
        (lent_node,) = nodes_of(borrower).values()
        assert lent_node in booked.values()
        (pool,) = (await c.stub.ListPools(scheduler_pb2.ListPoolsRequest())).pools
        lent = {x.node: list(x.jobs) for d in pool.domains for x in d.lent}
        assert lent == {lent_node: [borrower.id]}
        invariant_holds(c)
        await c.settled(gang.id, borrower.id)

        dead = next(n for r, n in sorted(nodes_of(gang).items()) if domain(n) == domain(lent_node))
        await agent(c, dead).partition()

        async def swapped():
            job = await c.job(gang.id)
            return job if job.attempt == 2 and job.state == RUNNING else None

        second = await eventually(swapped, what="the gang restarted on the borrowed pool node")
        assert lent_node in nodes_of(second).values() and second.failures == 0
        got = await c.job(borrower.id)
        assert got.preemptions == 1 and got.failures == 0
        outcome = c.sql("SELECT outcome, reason FROM job_attempts WHERE job_id = :j AND attempt = 1", j=borrower.id)
        assert outcome[0][0] == "PREEMPTED" and "preempted at once" in outcome[0][1]
        # No checkpoint handshake: no request was ever made to the borrower.
        assert c.sql("SELECT count(*) FROM checkpoint_requests WHERE job_id = :j", j=borrower.id) == [(0,)]
        # Requeued, it may borrow the other domain's pool node (it has a time limit).
        other = booked[next(d for d in booked if d != domain(lent_node))]
        again = await c.wait_running(borrower.id)
        assert list(nodes_of(again).values()) == [other]
        invariant_holds(c)


async def test_a_fatal_gpu_swaps_the_gangs_replica_onto_the_pool_node(db_url):
    async with cluster(db_url) as c:
        booked = await pool_with_one_per_domain(c)
        first = await c.wait_running((await c.submit("train", 4, 4)).id)
        await c.settled(first.id)
        node, gpu = nodes_of(first)[0], first.allocations[0].gpus[1]
        await report_fatal_gpu(c, node, gpu)
        second = await eventually(
            lambda: running_attempt(c, first.id, 2), what="replica 0 moved to the pool node of its domain"
        )
        assert nodes_of(second)[0] == booked[domain(node)] and second.failures == 0
        assert "pool spare" in second.last_swap
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=first.id) == [
            ("GPU_FAILED",)
        ]
        invariant_holds(c)
