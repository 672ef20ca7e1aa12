"""The fence in the pipeline (issue 35, docs/architecture/admission-path.md §5.3 v2), through a real scheduler and
LiteAgents on PostgreSQL.

A leader whose view is its own decides without waiting for the clock row's lock, and sends the lock, checked by the
server (phalanx_fence: the generation its view was built on, its lease unexpired), first with its closing writes
and COMMIT. These tests write to the ledger behind its back, as another replica's committed cycle or a takeover
would, and assert that the cycle that did not see it commits nothing, and that the retry decides on the ledger as
it is. Each fails when the server's check is left out (the cycle commits its stale decision).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_cycle
from sqlalchemy import text

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.commands import Submit
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.postgres

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING


def cluster(db_url: str, **settings) -> LiteCluster:
    names = ["node-0", "node-1"]
    # A short lease: the start's quiet time (two thirds of it, for followers to be heard) is short too
    config = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names), leader_lease_s=3.0, **settings
    )
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


def spec(gpus: int, name: str = "g") -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=gpus, command=["run"], priority=1)


async def submit(c: LiteCluster, gpus: int, name: str = "g") -> common_pb2.Job:
    return await c.scheduler.service.execute(Submit(spec=spec(gpus, name), request_id=uuid.uuid4().hex))


async def fencing_ahead(c: LiteCluster) -> None:
    """Wait until the leader's next cycle may decide before the lock (its start's quiet time is over), and a cycle
    ran after it: the scenario's own submit is then the next cycle."""
    service = c.scheduler.service
    await eventually(lambda: _async(service._fence_ahead(False)), what="the fence in the pipeline allowed")
    await next_cycle(service)


async def behind_its_back(c: LiteCluster, *statements: str) -> None:
    """Commit `statements` as another writer would, on the writer's thread so that no cycle of the scheduler runs
    meanwhile; and keep its next cycle from being the periodic look or the lease tick, which read the clock row
    first whatever (the scenario is the cycle that does not read it)."""
    service = c.scheduler.service

    def write():
        with service.engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
        service._last_sync = time.time()
        # (a second: the lease, renewed at each tick, keeps more than half its length meanwhile, as the path needs)
        service.leadership._next_tick = max(service.leadership._next_tick, time.time() + 1.0)

    await asyncio.get_running_loop().run_in_executor(service._writer, write)


async def allocations_of(c: LiteCluster, job_id: str) -> list[tuple[str, int]]:
    with c.scheduler.service.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT n.name, a.gpu_index FROM allocations a JOIN nodes n ON n.id = a.node_id "
                "WHERE a.job_id = :j AND a.released_at IS NULL"
            ),
            {"j": job_id},
        ).all()
    return sorted((r[0], r[1]) for r in rows)


async def _async(value):
    return value


async def test_a_leader_alone_decides_before_the_lock_and_its_reservations_hold(pg_url):
    async with cluster(pg_url) as c:
        service = c.scheduler.service
        await fencing_ahead(c)
        before = dict(service.fences)
        # (each with a request id: the cycle reads the ledger for it, a read that need not wait for the lock)
        jobs = [await submit(c, 1, f"one-{i}") for i in range(6)]
        assert [j.state for j in jobs] == [RUNNING] * 6
        held = [g for j in jobs for g in await allocations_of(c, j.id)]
        assert len(held) == len(set(held)) == 6
        assert service.state.capacity.free_gpus() == 16 - 6
        # and cancels (a job update queued before the pass, the attempt's end and release deferred)
        for job in jobs[:3]:
            await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
            assert await allocations_of(c, job.id) == []
        # none waited alone for the lock (it went with the closing writes), none refused; (a cycle of a lease tick
        # among them takes the lock first)
        after = {k: service.fences[k] - before[k] for k in service.fences}
        assert after["waited"] == 0 and after["refused"] == 0
        assert after["pipeline"] >= 9 - after["lock"] and after["pipeline"] > 0
        assert service.state.capacity.free_gpus() == 16 - 3


async def test_a_cycle_with_a_guarded_write_sends_the_fence_alone_and_waits_for_it(pg_url):
    async with cluster(pg_url) as c:
        service = c.scheduler.service
        await fencing_ahead(c)
        before = dict(service.fences)
        # An admin drain: the node's row is written before the pass (a write that locks it), so the clock row is
        # locked first, as every writer does, and the cycle waits for it there
        await c.stub.DrainNode(scheduler_pb2.DrainNodeRequest(node_name="node-0", reason="fence test"))
        assert service.fences["waited"] == before["waited"] + 1
        assert service.state.nodes["node-0"].state == "DRAINED"


async def test_another_writer_since_the_view_makes_the_server_refuse_the_cycle_and_the_retry_sees_it(pg_url):
    async with cluster(pg_url) as c:
        service = c.scheduler.service
        filler = await submit(c, 8, "filler")
        assert filler.state == RUNNING
        full = filler.allocations[0].node
        other = ({"node-0", "node-1"} - {full}).pop()
        await c.settled(filler.id)
        await fencing_ahead(c)
        refused, reloads = service.fences["refused"], service.view_reloads["full"]
        # Another replica drained the only node with room, and committed (its notice not heard yet)
        await behind_its_back(
            c,
            f"UPDATE nodes SET state = 'DRAINED', cordoned = true WHERE name = '{other}'",
            "UPDATE ledger_clock SET generation = generation + 1 WHERE id = 1",
        )
        job = await submit(c, 8, "late")
        # The view still had the node READY: the cycle placed the gang there, the fence refused its commit, and the
        # retry, on the reloaded view, left it pending
        assert job.state == PENDING and await allocations_of(c, job.id) == []
        assert service.fences["refused"] == refused + 1
        assert service.view_reloads["full"] == reloads + 1
        assert service.state.nodes[other].state == "DRAINED"
        # after a refusal, cycles take the lock first for a while
        assert not service._fence_ahead(False)


async def test_a_leader_whose_lease_was_taken_is_refused_and_steps_down_without_reserving(pg_url):
    async with cluster(pg_url) as c:
        service = c.scheduler.service
        await fencing_ahead(c)
        generation = service._generation
        # Another replica took the lease (this one stalled past it, as far as the ledger knows)
        await behind_its_back(
            c,
            "UPDATE ledger_clock SET leader = 'intruder', leader_epoch = leader_epoch + 1, "
            "leader_until = extract(epoch FROM clock_timestamp()) + 600 WHERE id = 1",
        )
        job = await submit(c, 1, "deposed")
        # written as a follower writes a submission: pending, nothing reserved under the lost epoch
        assert job.state == PENDING and await allocations_of(c, job.id) == []
        assert not service.leading
        assert service.fences["refused"] == 1
        with service.engine.connect() as conn:
            assert conn.execute(text("SELECT generation FROM ledger_clock")).scalar() == generation + 1
