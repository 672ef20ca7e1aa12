"""The storm (issue 17, ledger truth): two scheduler replicas on PostgreSQL, real node agents whose state
directories come from an earlier ledger, 200 concurrent gangs with cancels, watched through the API while it runs.

What the API shows at every sample, not only the ledger's rows afterwards:
- a job that is not RUNNING shows no allocations (the GPUs of its earlier attempts are history);
- no GPU is held by two RUNNING jobs;
- every job reaches an end state within STORM_BOUND_S of the last submission.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from helpers.pg import create_database, drop_database
from helpers.procs import ROOT, eventually, start_scheduler
from sqlalchemy import create_engine, text

from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.postgres

TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_FAILED}
RUNNING = common_pb2.JOB_STATE_RUNNING
NODES = [f"storm-{i:02d}" for i in range(4)]
GANGS = 200
STORM_BOUND_S = 150.0  # the last submission to every job in an end state, on a loaded 2-core machine
SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (3, 8), (4, 8)]
TIMERS = [
    "--lease-timeout",
    "6",
    "--heartbeat-interval",
    "1",
    "--launch-timeout",
    "20",
    "--leader-lease",
    "3",
    "--retry-backoff",
    "0.2",
    "--retry-backoff-max",
    "1",
]


def _start_agents(target: str, state: Path, logs: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PHALANX_LOG_LEVEL="INFO")
    procs = []
    for name in NODES:
        log = open(logs / f"agent-{name}.log", "ab")  # closed when the test ends (the process holds it)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.node_agent.main",
                    "--scheduler",
                    target,
                    "--node-name",
                    name,
                    "--simulate",
                    "dgx-h100",
                    "--state-dir",
                    str(state / name),
                    "--kill-grace",
                    "1",
                    # The ranks are this interpreter: run them as this user (an agent running as root would
                    # otherwise run them as nobody, who may not reach it).
                    "--run-as",
                    getpass.getuser(),
                ],
                stdout=log,
                stderr=log,
                env=env,
                cwd=str(ROOT),
            )
        )
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def _ready(stub) -> bool:
    nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest(), timeout=10)).nodes
    return sorted(n.name for n in nodes if n.state == common_pb2.NODE_STATE_READY) == NODES


async def _run_jobs(stubs, count: int, rng: random.Random, *, cancel_share: float) -> list[str]:
    async def one(i: int) -> str:
        r, g = rng.choice(SHAPES)
        spec = common_pb2.JobSpec(
            name=f"storm-{i}",
            replicas=r,
            gpus_per_replica=g,
            procs_per_replica=1,
            command=["sleep", f"{rng.uniform(0.05, 0.4):.2f}"],
        )
        job = await stubs[i % 2].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)
        if rng.random() < cancel_share:
            await asyncio.sleep(rng.uniform(0, 1.0))
            await stubs[(i + 1) % 2].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
        return job.id

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def _check_view(jobs, seen_problems: list[str]) -> None:
    held: dict[tuple[str, int], str] = {}
    for job in jobs:
        if job.state != RUNNING:
            if len(job.allocations):
                seen_problems.append(
                    f"{job.id} is {common_pb2.JobState.Name(job.state)} and shows {len(job.allocations)} allocations"
                )
            continue
        for a in job.allocations:
            if a.gpu_milli or len(a.slices):
                continue  # the storm's gangs hold whole GPUs only
            for gpu in a.gpus:
                key = (a.node, gpu)
                if key in held:
                    seen_problems.append(f"GPU {key} shown held by {held[key]} and {job.id}")
                held[key] = job.id


async def test_storm_through_two_replicas_with_agents_from_an_earlier_ledger(pg_url, tmp_path):
    state, logs = tmp_path / "agents", tmp_path / "logs"
    state.mkdir()
    logs.mkdir()
    rng = random.Random(17)

    # An earlier ledger: the agents' state directories record the revisions they acked on it.
    replicas = [start_scheduler(pg_url, logs / f"first-{i}.log", *TIMERS) for i in range(2)]
    agents = _start_agents(",".join(r.address for r in replicas), state, logs)
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    try:
        await eventually(lambda: _ready(stubs[0]), timeout=60, interval=0.5, what="the agents READY (first ledger)")
        ids = await _run_jobs(stubs, 40, rng, cancel_share=0.0)

        async def first_done():
            jobs = (await stubs[0].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000), timeout=10)).jobs
            return all(j.state in TERMINAL for j in jobs if j.id in set(ids))

        await eventually(first_done, timeout=90, interval=0.5, what="the first ledger's jobs done")
    finally:
        _stop(agents)
        for ch in channels:
            await ch.close()
        for r in replicas:
            r.terminate()
    assert all((state / name).is_dir() for name in NODES)

    # A new ledger, the same node names and state directories.
    url = create_database(pg_url, "phalanx_storm")  # a fresh ledger beside the session's
    upgrade(url)
    replicas = [start_scheduler(url, logs / f"second-{i}.log", *TIMERS) for i in range(2)]
    agents = _start_agents(",".join(r.address for r in replicas), state, logs)
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    problems: list[str] = []
    samples = 0
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        nonlocal samples
        while not stop_sampling.is_set():
            stub = stubs[samples % 2]
            try:
                jobs = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000), timeout=10)).jobs
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
                continue
            _check_view(jobs, problems)
            samples += 1
            await asyncio.sleep(0.2)

    try:
        await eventually(lambda: _ready(stubs[0]), timeout=60, interval=0.5, what="the agents READY (new ledger)")
        sampler = asyncio.create_task(sample())
        ids = await _run_jobs(stubs, GANGS, rng, cancel_share=0.2)
        submitted = time.monotonic()
        assert len(set(ids)) == GANGS

        async def all_done():
            jobs = (await stubs[1].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000), timeout=10)).jobs
            return len(jobs) == GANGS and all(j.state in TERMINAL for j in jobs)

        await eventually(all_done, timeout=STORM_BOUND_S, interval=0.5, what="every gang in an end state")
        drained_s = time.monotonic() - submitted
        stop_sampling.set()
        await sampler
        print(
            f"storm: {GANGS} gangs in an end state {drained_s:.1f} s after the last submission; {samples} API samples"
        )
        assert samples >= 10
        assert not problems, problems[:10]
        jobs = (await stubs[0].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000), timeout=10)).jobs
        assert not [j.id for j in jobs if j.state == common_pb2.JOB_STATE_FAILED]
        assert sum(j.state == common_pb2.JOB_STATE_SUCCEEDED for j in jobs) > GANGS // 2

        engine = create_engine(url)
        with engine.connect() as conn:
            double = conn.execute(
                text(
                    "SELECT a.gpu_id FROM allocations a JOIN allocations b ON a.gpu_id = b.gpu_id AND a.id < b.id "
                    "AND a.unit = b.unit AND a.kind <> 'share' AND b.kind <> 'share' "
                    "AND a.reserved_at < COALESCE(b.released_at, 'infinity') "
                    "AND b.reserved_at < COALESCE(a.released_at, 'infinity')"
                )
            ).all()
            active = conn.execute(text("SELECT count(*) FROM allocations WHERE released_at IS NULL")).scalar()
        engine.dispose()
        assert double == [], "a GPU was held by two allocations at once"
        assert active == 0
    finally:
        stop_sampling.set()
        _stop(agents)
        for ch in channels:
            await ch.close()
        for r in replicas:
            r.terminate()
        drop_database(url, pg_url)
