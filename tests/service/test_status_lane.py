"""The status lane (issue 35, item 2): rank reports, heartbeats and acks reach the ledger on a path that never
waits behind a decision, and the cycle reads their effect (services/scheduler/status_lane.py)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from helpers.lite_cluster import LiteCluster, run_sql
from helpers.waits import eventually, next_cycle
from sqlalchemy import text

from db.engine import make_engine
from phalanx.api.v1 import common_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler import ledger
from services.scheduler.commands import Submit
from services.scheduler.settings import SchedulerSettings

NAMES = ["node-0", "node-1"]


def cluster(db_url: str, **settings) -> LiteCluster:
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(NAMES), **settings)
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in NAMES])


def rank_state(c: LiteCluster, job_id: str, rank: int) -> str | None:
    rows = c.sql("SELECT state FROM ranks WHERE job_id = :j AND rank = :r", j=job_id, r=rank)
    return rows[0][0] if rows else None


@pytest.mark.postgres
async def test_a_rank_report_and_heartbeats_reach_the_ledger_while_a_decision_holds_the_scheduling_lock(pg_url):
    """Another transaction holds the clock row (the lock every cycle takes first), so the scheduler's next cycle
    waits. A rank report is still answered and its row committed, and heartbeats still reach `nodes`; once the lock
    goes, the cycle applies the report to the view. (On the old path the report was a cycle command and waited.)"""
    async with cluster(pg_url, heartbeat_interval=0.2, heartbeat_persist_interval=0.2) as c:
        service = c.scheduler.service
        job = await c.submit("quiet", 2, 8, ("hang",))  # its ranks are launched and never report
        await c.wait_running(job.id)
        with c.holding_the_clock_row():
            beat_before = c.sql("SELECT max(last_heartbeat) FROM nodes")[0][0]
            submit = asyncio.ensure_future(c.submit("behind-the-lock", 1, 1))  # a decision: it waits for the lock

            await eventually(c.a_session_waits_for_a_lock, what="a cycle waiting for the clock row")
            stale = await asyncio.wait_for(c.agents[0]._report(job.id, 1, 0, common_pb2.RANK_STATE_RUNNING, 0), 10)
            assert stale is False
            assert rank_state(c, job.id, 0) == "RUNNING"  # committed, while no cycle could run
            await eventually(lambda: _raised(c, beat_before), what="a heartbeat written while the lock is held")
            assert not submit.done() and service.intake.rank_reports["lane"] >= 1
        await submit
        await next_cycle(service)
        assert service.state.jobs[job.id].ranks[0].state == "RUNNING"  # the cycle applied what the lane recorded


async def _raised(c: LiteCluster, before: float) -> bool:
    return c.sql("SELECT max(last_heartbeat) FROM nodes")[0][0] > before + 0.5


async def test_an_ended_rank_the_lane_recorded_is_applied_by_a_leader_that_reloads_its_view(db_url):
    """The lane committed a rank's end, and the replica stopped before a cycle applied it (here: the row is written
    as the lane writes it, and the view reloaded as a new leader's is). The reload settles it: the gang is torn down
    as that report would have done, not left RUNNING with an ended rank."""
    async with cluster(db_url) as c:
        service = c.scheduler.service
        job = await c.submit("will-fail", 2, 8, ("hang",))
        running = await c.wait_running(job.id)
        node = c.sql("SELECT id FROM nodes WHERE name = :n", n=running.allocations[0].node)[0][0]
        engine = make_engine(db_url)
        try:
            with engine.begin() as conn:
                ledger.record_ranks(
                    conn,
                    [
                        dict(
                            job_id=job.id,
                            attempt=1,
                            rank=0,
                            replica=0,
                            local_rank=0,
                            node_id=node,
                            state="EXITED",
                            exit_code=3,
                            pid=0,
                            message="",
                            updated_at=0.0,
                        )
                    ],
                )
        finally:
            engine.dispose()
        service._resync = True  # the next cycle reloads the whole view, as a new leader's first does
        await next_cycle(service)
        done = await c.job(job.id)
        assert done.state == common_pb2.JOB_STATE_FAILED and "exited with code 3" in done.message


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no-lane"])
async def test_heartbeats_and_acks_reach_the_ledger_without_moving_its_generation(db_url, lane):
    """With the lane, heartbeats and acks are written outside every cycle: the ledger's generation (which every
    other replica polls, and which a cycle moves when it commits a change) stays where it was. Without it, cycles
    write them and move it."""
    async with cluster(db_url, heartbeat_interval=0.2, heartbeat_persist_interval=0.2, status_lane=lane) as c:
        service = c.scheduler.service

        async def nodes_heard():  # a node's first heartbeat is its health report, a command that moves it
            return all(n.health == "HEALTHY" for n in service.state.nodes.values())

        await eventually(nodes_heard, what="every node's first heartbeat applied")
        await next_cycle(service)
        generation = c.sql("SELECT generation FROM ledger_clock WHERE id = 1")[0][0]
        before = c.sql("SELECT min(last_heartbeat) FROM nodes")[0][0]

        async def both_beats_written():
            return c.sql("SELECT min(last_heartbeat) FROM nodes")[0][0] > before + 0.5

        await eventually(both_beats_written, what="every node's heartbeat written again")
        moved = c.sql("SELECT generation FROM ledger_clock WHERE id = 1")[0][0] != generation
        assert moved is (not lane)


@pytest.mark.postgres
async def test_the_lanes_node_write_skips_a_row_a_cycle_holds_and_never_lowers_a_value(pg_url):
    """`ledger.raise_node_status` on PostgreSQL: a node row another transaction holds (as a cycle holds the rows it
    updates) is left for the next batch instead of waited for, and a value is only ever raised."""
    async with cluster(pg_url) as c:
        ids = dict(c.sql("SELECT name, id FROM nodes"))
        held, free = ids["node-0"], ids["node-1"]
        far = 4e9  # later than any heartbeat the agents send meanwhile
        engine = make_engine(pg_url)
        try:
            with engine.connect() as cycle_conn, engine.connect() as lane_conn:
                with cycle_conn.begin():
                    cycle_conn.execute(text("SELECT id FROM nodes WHERE id = :i FOR UPDATE"), {"i": held})
                    with lane_conn.begin():
                        left = ledger.raise_node_status(lane_conn, {held: far, free: far}, {free: 7})
                    assert left == {held}
                with lane_conn.begin():
                    assert ledger.raise_node_status(lane_conn, {held: far, free: far - 1}, {free: 3}) == set()
        finally:
            engine.dispose()
        rows = dict(
            ((n, (beat, acked)) for n, beat, acked in c.sql("SELECT id, last_heartbeat, acked_revision FROM nodes"))
        )
        assert rows[held][0] == far and rows[free] == (far, 7)


async def _value(value):
    return value


@pytest.mark.postgres
async def test_a_gang_whose_ranks_report_to_two_replicas_ends_when_its_last_rank_reports_to_the_follower(pg_url):
    """Agents may be connected to different replicas. The leader's lane records rank 0's end and its cycle applies
    it; then rank 1's end goes to the follower, whose cycle writes it. Neither report saw the other on the way (the
    lane writes outside the cycles' lock), yet the gang must end: the follower reads rank 0's state (announced by
    the cycle that applied it), or the leader settles the gang when it reads the follower's write."""
    from services.scheduler.main import serve

    names = ["node-0", "node-1"]
    fabric = default_fabric(names)
    leader = await serve(SchedulerSettings(db_url=pg_url, listen="127.0.0.1:0", replica_id="a", fabric=fabric))
    await eventually(lambda: _value(leader.service.leading), what="replica a to lead")
    follower = await serve(SchedulerSettings(db_url=pg_url, listen="127.0.0.1:0", replica_id="b", fabric=fabric))
    agents = [LiteAgent(leader.address, "node-0"), LiteAgent(follower.address, "node-1")]
    for agent in agents:
        await agent.start()
    try:
        a = leader.service
        await eventually(lambda: _value(a.state.capacity.free_gpus() == 16), what="both nodes READY")
        spec = common_pb2.JobSpec(name="split", replicas=2, gpus_per_replica=8, procs_per_replica=1, command=["hang"])
        job = await a.submit(Submit(spec=spec, request_id=uuid.uuid4().hex))
        assert job.state == common_pb2.JOB_STATE_RUNNING
        b = follower.service  # it has read the reservation (else its report would read the gang from the ledger)
        await eventually(lambda: _value(getattr(b.state.jobs.get(job.id), "state", "") == "RUNNING"), what="b's view")
        on = {alloc.node: alloc.replica for alloc in job.allocations}
        leader_rank, follower_rank = on["node-0"], on["node-1"]
        assert await agents[0]._report(job.id, 1, leader_rank, common_pb2.RANK_STATE_EXITED, 0) is False
        await next_cycle(a)  # the leader's cycle applied it: the gang still runs (one rank left)
        assert a.state.jobs[job.id].state == "RUNNING" and a.intake.rank_reports["lane"] >= 1
        assert await agents[1]._report(job.id, 1, follower_rank, common_pb2.RANK_STATE_EXITED, 0) is False
        # Committed by the follower's cycle when it answered; the leader's next cycle reads it before anything else
        await next_cycle(a)
        assert run_sql(pg_url, "SELECT state FROM jobs WHERE id = :j", j=job.id) == [("SUCCEEDED",)]
    finally:
        for agent in agents:
            await agent.stop()
        await follower.stop()
        await leader.stop()
