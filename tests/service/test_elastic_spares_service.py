"""An elastic gang with segments and spares kept in the domain (`--replicas 2:4 --segment 2 --spares-per-segment 1`)
through the scheduler service (LiteCluster, SQLite and PostgreSQL), on two NVLink domains of three 4-GPU nodes: the
policy spares+elastic of the issue's evaluation, run by the scheduler. It starts with the one segment that fits (and
its spare), grows by a whole segment with its spare through the checkpoint handshake, swaps a spare in when a node
of it is lost, and when a second loss finds no spare in that domain it shrinks to the segment it still has, at once,
without a failure counted. Its ledger history keeps the invariants, (h), (i) and (j) included."""

from __future__ import annotations

import pytest
from helpers.checkpoints import commit_checkpoint
from helpers.lite_cluster import LiteCluster
from helpers.two_domains import RUNNING, agent, cluster, domain, nodes_of
from helpers.waits import eventually

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core import invariants as inv
from phalanx.core.snapshot import ElasticPolicy
from phalanx.testing.history import history_from_ledger
from services.common import metrics

GROW = ElasticPolicy(grow_interval_s=0.0, min_step=1, min_fraction=0.25, grace_period_s=30.0)


async def job_where(c: LiteCluster, job_id: str, what: str, check) -> common_pb2.Job:
    async def look():
        job = await c.job(job_id)
        return job if check(job) else None

    return await eventually(look, what=f"job {job_id}: {what}")


def check_segments(job: common_pb2.Job) -> None:
    """Each segment's ranks and its spare in the segment's domain; no rank on a spare."""
    ranks = nodes_of(job)
    assert sorted(ranks) == list(range(job.current_replicas))
    for r, node in ranks.items():
        assert domain(node) == job.segment_domains[r // 2]
    for s in job.spares:
        assert s.domain == job.segment_domains[s.segment]
        assert not s.booked or (domain(s.node) == s.domain and s.node not in ranks.values())


@pytest.mark.slow
async def test_an_elastic_gang_with_spares_grows_swaps_and_shrinks_by_whole_segments(db_url):
    async with cluster(db_url, elastic=GROW, retry_backoff_s=30.0, preemption_poll_s=0.1) as c:
        blocker = await c.submit("blocker", 1, 4)
        held = nodes_of(await c.wait_running(blocker.id))[0]
        gang = await c.submit("train", 4, 4, segment=2, spares_per_segment=1, min_replicas=2)
        assert (gang.spec.min_replicas, gang.spec.segment, gang.spec.spares_per_segment) == (2, 2, 1)

        # One domain is free: the gang starts with its minimum, one segment and that segment's spare.
        first = await job_where(c, gang.id, "running at 2", lambda j: j.state == RUNNING and j.current_replicas == 2)
        check_segments(first)
        assert [s.booked for s in first.spares] == [True] and first.segment_domains[0] != domain(held)
        assert "1 of at most 2 segments" in first.placement.reason
        c.scheduler.service._update_gauges()  # (what the scheduler runs on its metrics timer)
        assert metrics.GPUS_SPARE._value.get() == 4  # the spare: held, charged, counted, and no rank's
        assert metrics.GPUS_ALLOCATED._value.get() == 4 + 2 * 4 + 4  # the blocker, the 2 ranks and the spare

        # The blocker ends: the gang is asked to checkpoint for its grow, and once that is committed it grows by a
        # whole segment, with its spare, in the other domain.
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=blocker.id))
        asked = await job_where(c, gang.id, "asked to grow", lambda j: j.preempted_by == gang.id)
        assert "growing from 1 to 2 of at most 2 segments" in asked.message, asked.message
        commit_checkpoint(db_url, gang.id, 1, 7, 8)  # a rank per GPU: 2 replicas x 4
        grown = await job_where(c, gang.id, "grown to 4", lambda j: j.state == RUNNING and j.current_replicas == 4)
        check_segments(grown)
        assert grown.attempt == 2 and grown.failures == 0 and len(set(grown.segment_domains)) == 2
        assert [(s.segment, s.booked) for s in grown.spares] == [(0, True), (1, True)]
        # The ledger's history so far keeps the invariants ((h), (i), (j) included). (Not past the swap below: the
        # history does not rebuild a swap from the ledger, phalanx.testing.history; the model world judges those.)
        assert inv.check(history_from_ledger(db_url, grace_s=30.0), grace_s=30.0, tick_s=1.0) == []

        # A node of segment 1 is lost: its domain's spare takes its replica; same size, no requeue.
        await c.settled(gang.id)
        dead = nodes_of(grown)[2]
        spare = next(s.node for s in grown.spares if s.segment == 1)
        await agent(c, dead).partition()
        swapped = await job_where(c, gang.id, "swapped", lambda j: j.state == RUNNING and j.attempt == 3)
        assert swapped.swaps == 1 and swapped.current_replicas == 4 and nodes_of(swapped)[2] == spare
        assert [(s.segment, s.booked) for s in swapped.spares] == [(0, True), (1, False)]

        # Another node of segment 1 is lost: no spare is left in that domain, so it shrinks to segment 0 at once.
        await c.settled(gang.id)
        await agent(c, nodes_of(swapped)[3]).partition()
        shrunk = await job_where(c, gang.id, "shrunk", lambda j: j.state == RUNNING and j.current_replicas == 2)
        check_segments(shrunk)
        assert shrunk.failures == 0 and shrunk.not_before == 0  # no failure counted, no backoff waited
        assert shrunk.segment_domains[0] == grown.segment_domains[0]  # on the segment it still had
        assert [s.booked for s in shrunk.spares] == [True]
