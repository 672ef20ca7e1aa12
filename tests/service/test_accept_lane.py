"""The accept lane (issue 35, deep queues): a submission that waits for a pass whatever happens (a PENDING job of
its priority or a higher one is ahead of it) is written PENDING by the status lane and answered then, not after
the cycles in flight; the next cycle adopts it and the pass decides it (SchedulerService.submit)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.waits import eventually, next_cycle
from prometheus_client import REGISTRY

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
NAMES = ["node-0", "node-1"]


def cluster(db_url: str, **settings) -> LiteCluster:
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(NAMES), **settings)
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in NAMES])


async def blocked_head(c: LiteCluster) -> tuple[common_pb2.Job, common_pb2.Job]:
    """A filler on one node with a time limit, and a head that needs both nodes: blocked, with a reservation."""
    filler = await c.submit("filler", 1, 8, time_limit_s=600)
    await c.wait_running(filler.id)
    head = await c.submit("head", 2, 8)
    assert head.state == PENDING
    await c.settled(filler.id)
    return filler, head


async def test_a_submission_behind_a_pending_job_is_answered_once_written_and_the_pass_decides_it(db_url):
    async with cluster(db_url) as c:
        service = c.scheduler.service
        filler, head = await blocked_head(c)
        before = dict(service.admissions)
        request = uuid.uuid4().hex
        spec = common_pb2.JobSpec(name="behind", replicas=1, gpus_per_replica=8, command=["run"])
        behind = await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id=request))
        assert behind.state == PENDING and behind.message == "queued"
        assert service.admissions["accept"] == before["accept"] + 1 and service.admissions["pass"] == before["pass"]
        # Written when answered, with the reply's id
        assert c.sql("SELECT state FROM jobs WHERE id = :j", j=behind.id) == [("PENDING",)]
        # The next cycle adopts it and the pass decides it by the same rules as any: no jump over the head (a gang
        # without a time limit on the head's reserved node would delay it), so it waits, with the pass's reason.
        await next_cycle(service)
        assert behind.id in service.state.jobs
        assert (await c.job(behind.id)).state == PENDING and (await c.job(head.id)).state == PENDING
        # The same request again is the same job (idempotent through the cycle's path)
        again = await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id=request))
        assert again.id == behind.id
        assert c.sql("SELECT count(*) FROM jobs WHERE name = 'behind'") == [(1,)]
        # A higher priority is ahead of the queue: not accepted, decided at submit
        higher = await c.submit("higher", 1, 8, priority=1)
        assert higher.state == RUNNING and service.admissions["accept"] == before["accept"] + 1
        # The accepted job runs once the capacity it waits for is there: cancel the filler and the higher gang
        for job in (filler, higher):
            await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        await c.wait_running(head.id)
        assert (await c.job(behind.id)).state == PENDING  # behind the head, in order
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=head.id))
        await c.wait_running(behind.id)


async def test_without_the_accept_lane_the_same_submission_waits_for_its_cycle(db_url):
    async with cluster(db_url, accept_lane=False) as c:
        service = c.scheduler.service
        await blocked_head(c)
        before = dict(service.admissions)
        behind = await c.submit("behind", 1, 8)
        assert behind.state == PENDING and service.admissions["accept"] == before["accept"]
        assert service.admissions["pass"] == before["pass"] + 1


@pytest.mark.postgres
async def test_an_accepted_submission_is_answered_while_a_decision_holds_the_scheduling_lock(pg_url):
    """Another transaction holds the clock row, so every cycle waits: a submission behind the queue is still
    written and answered; the cycle adopts it once the lock goes."""
    async with cluster(pg_url) as c:
        service = c.scheduler.service
        await blocked_head(c)
        with c.holding_the_clock_row():
            waiting = asyncio.ensure_future(c.submit("decision", 1, 1, priority=3))  # a cycle: waits for the lock

            await eventually(c.a_session_waits_for_a_lock, what="a cycle waiting for the clock row")
            behind = await asyncio.wait_for(c.submit("behind", 1, 8), 10)
            assert behind.state == PENDING and not waiting.done()
            assert c.sql("SELECT state FROM jobs WHERE id = :j", j=behind.id) == [("PENDING",)]
        await waiting
        await next_cycle(service)
        assert service.state.jobs[behind.id].state == "PENDING"


async def test_an_accepted_submission_does_not_wait_behind_a_batch_of_rank_reports(db_url, monkeypatch):
    """Accepted submissions have a writer of their own: a batch of the status lane (rank rows, heartbeats) that takes
    long, here held on an event, does not hold them back."""
    async with cluster(db_url) as c:
        service = c.scheduler.service
        await blocked_head(c)
        lane = service.status_lane
        assert lane is not None and service.accept_writer is not None and service.accept_writer is not lane
        held, entered = threading.Event(), threading.Event()

        def slow_batch(rows, jobs, beats, acks):
            entered.set()
            held.wait(30)
            return set(), set()

        monkeypatch.setattr(lane, "_commit", slow_batch)
        accepts_before = _lane_batches("accept")
        report = asyncio.ensure_future(lane.record_rank({"job_id": "held"}))
        try:
            await eventually(lambda: _async(entered.is_set()), what="the status lane inside its batch")
            behind = await asyncio.wait_for(c.submit("behind", 1, 8), 10)
            assert behind.state == PENDING and behind.message == "queued" and not report.done()
            assert c.sql("SELECT state FROM jobs WHERE id = :j", j=behind.id) == [("PENDING",)]
            assert _lane_batches("accept") == accepts_before + 1  # timed apart from the status lane's
        finally:
            held.set()
        await report


def _lane_batches(lane: str) -> float:
    return REGISTRY.get_sample_value("phalanx_scheduler_status_lane_batch_seconds_count", {"lane": lane}) or 0.0


async def _async(value):
    return value
