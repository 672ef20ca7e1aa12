"""Two scheduler replicas on one PostgreSQL: concurrent gang storms never double-book or split a gang."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from helpers.procs import eventually, start_scheduler
from sqlalchemy import create_engine, text

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent

TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_FAILED}
pytestmark = pytest.mark.postgres


async def test_two_replicas_hundreds_of_gangs_random_cancels(pg_url, tmp_path):
    replicas = [start_scheduler(pg_url, tmp_path / f"replica{i}.log") for i in range(2)]
    agents = [LiteAgent(replicas[i % 2].address, f"node-{i:02d}") for i in range(8)]
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    rng = random.Random(7)
    try:
        for a in agents:
            await a.start()

        async def submit(i: int) -> str:
            r, g = rng.choice([(1, 1), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (2, 4)])
            spec = common_pb2.JobSpec(
                name=f"storm-{i}", replicas=r, gpus_per_replica=g, command=["sleep", f"{rng.uniform(0.02, 0.25):.3f}"]
            )
            job = await stubs[i % 2].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)
            if rng.random() < 0.2:
                await asyncio.sleep(rng.uniform(0, 0.3))
                await stubs[(i + 1) % 2].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
            return job.id

        ids = await asyncio.gather(*(submit(i) for i in range(240)))
        assert len(set(ids)) == 240

        async def all_done():
            jobs = (await stubs[0].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs
            return len(jobs) == 240 and all(j.state in TERMINAL for j in jobs)

        await eventually(all_done, timeout=120, interval=0.5, what="every job in an end state")
        jobs = (await stubs[1].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs
        assert not [j for j in jobs if j.state == common_pb2.JOB_STATE_FAILED]

        engine = create_engine(pg_url)
        with engine.connect() as conn:
            double = conn.execute(
                text(
                    "SELECT a.gpu_id FROM allocations a JOIN allocations b ON a.gpu_id = b.gpu_id AND a.id < b.id "
                    "AND a.reserved_at < COALESCE(b.released_at, 'infinity') "
                    "AND b.reserved_at < COALESCE(a.released_at, 'infinity')"
                )
            ).all()
            partial = conn.execute(
                text(
                    "SELECT a.job_id, a.attempt FROM allocations a JOIN jobs j ON j.id = a.job_id "
                    "GROUP BY a.job_id, a.attempt, j.replicas, j.gpus_per_replica "
                    "HAVING count(*) <> j.replicas * j.gpus_per_replica "
                    "OR count(DISTINCT a.released_at) > 1"
                )
            ).all()
            active = conn.execute(text("SELECT count(*) FROM allocations WHERE released_at IS NULL")).scalar()
            ran = conn.execute(text("SELECT count(*) FROM jobs WHERE state = 'SUCCEEDED'")).scalar()
        engine.dispose()
        assert double == [], "a GPU was held by two allocations at once"
        assert partial == [], "a gang held only part of its GPUs"
        assert active == 0
        assert ran > 100
        # Work reserved by either replica reached agents connected to the other.
        reached = {a.name: {launch.job_id for launch in a.launched} for a in agents}
        assert all(reached.values())
    finally:
        for a in agents:
            await a.stop()
        for ch in channels:
            await ch.close()
        for r in replicas:
            r.terminate()
