"""Crash the scheduler during a preemption and the checkpoint coordinator during a commit (fail points and
kill -9): on restart each recovers to a consistent state, and nothing is lost, done twice or half done."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from helpers.jobs import insert_job
from helpers.lite_cluster import run_sql
from helpers.ports import reserved_port
from helpers.procs import ServiceProcess, eventually

from db.engine import make_engine
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from phalanx.train import Checkpointer, CheckpointRejectedError
from services.checkpoint_coordinator import store
from services.common.faults import EXIT_CODE

pytestmark = pytest.mark.slow

PENDING, RUNNING, PREEMPTING = (
    common_pb2.JOB_STATE_PENDING,
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_PREEMPTING,
)


def free_port() -> int:
    return reserved_port()  # restarted on the same address: no port-0 bind may take it meanwhile


def scheduler(db_url: str, log, port: int, failpoints: str = "") -> ServiceProcess:
    args = [
        "--db",
        db_url,
        "--listen",
        f"127.0.0.1:{port}",
        "--lease-timeout",
        "8",
        "--heartbeat-interval",
        "0.5",
        "--min-runtime",
        "0",
        "--preemption-grace",
        "60",
        "--retry-backoff",
        "0.2",
    ]
    return ServiceProcess("services.scheduler.main", args, log, env={"PHALANX_FAILPOINTS": failpoints})


async def test_scheduler_killed_during_a_preemption_and_at_the_handover_recovers(db_url, tmp_path):
    port = free_port()
    sched = scheduler(db_url, tmp_path / "s1.log", port)
    agents = [LiteAgent(sched.address, f"node-{i}") for i in range(2)]
    channel = grpc.aio.insecure_channel(sched.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def job(job_id):
        return await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), wait_for_ready=True, timeout=20)

    async def state(job_id, st):
        j = await job(job_id)
        return j if j.state == st else None

    def submit(name, priority, replicas):
        spec = common_pb2.JobSpec(name=name, replicas=replicas, gpus_per_replica=8, command=["run"], priority=priority)
        return stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

    try:
        for a in agents:
            await a.start()
        low = await submit("low", 0, 2)
        await eventually(lambda: state(low.id, RUNNING), what="victim running")
        high = await submit("high", 100, 1)
        await eventually(lambda: state(low.id, PREEMPTING), what="victim asked to checkpoint")

        # 1. kill -9 while the victim checkpoints: the preemption is in the ledger and goes on after a restart,
        # here with a fail point armed at the handover.
        sched.kill9()
        sched = scheduler(db_url, tmp_path / "s2.log", port, failpoints="scheduler.handover")
        assert (await job(low.id)).state == PREEMPTING and (await job(high.id)).state == PENDING

        # 2. The victim's checkpoint commits; the cycle that stops it and reserves the preemptor dies before its
        # commit: none of it happened.
        engine = make_engine(db_url)
        for rank in range(16):
            store.report_shard(engine, low.id, 1, 42, 16, store.ShardRecord(rank, f"file:///c/{rank}", 1, "sha256:x"))
        engine.dispose()
        await asyncio.to_thread(sched.proc.wait, 20)
        assert sched.proc.returncode == EXIT_CODE
        assert run_sql(db_url, "SELECT state, preempted_by FROM jobs WHERE id = :j", j=low.id) == [("RUNNING", high.id)]
        assert run_sql(db_url, "SELECT count(*) FROM allocations WHERE job_id = :j", j=high.id) == [(0,)]
        assert run_sql(
            db_url,
            "SELECT count(*) FROM allocations WHERE job_id = :j AND released_at IS NULL AND kind = 'gpu'",
            j=low.id,
        ) == [(16,)]

        # 3. Restarted without the fail point: the handover happens once, whole.
        sched.terminate()
        sched = scheduler(db_url, tmp_path / "s3.log", port)
        running = await eventually(lambda: state(high.id, RUNNING), timeout=20, what="preemptor running")
        requeued = await job(low.id)
        assert requeued.state == PENDING and requeued.preemptions == 1 and requeued.failures == 0
        assert run_sql(db_url, "SELECT outcome, committed_step FROM job_attempts WHERE job_id = :j", j=low.id) == [
            ("PREEMPTED", 42)
        ]
        active = run_sql(
            db_url,
            "SELECT gpu_id, count(*) FROM allocations WHERE released_at IS NULL AND kind = 'gpu' GROUP BY gpu_id",
        )
        assert len(active) == 8 and all(n == 1 for _, n in active)
        assert running.attempt == 1
        await eventually(lambda: _launched(agents, high.id), what="preemptor launched")
        # The ledger's outbox holds every assignment the schedulers committed (agents receive only those): one launch.
        assert run_sql(
            db_url,
            "SELECT attempt, count(*) FROM assignments WHERE job_id = :j AND kind = 'launch' GROUP BY attempt",
            j=high.id,
        ) == [(1, 1)]
        launches = [
            (launch.job_id, launch.attempt, launch.replica)
            for a in agents
            for launch in a.launched
            if launch.job_id == high.id
        ]
        assert launches == [(high.id, 1, 0)]  # launched once
        assert any(k.job_id == low.id and k.attempt == 1 for a in agents for k in a.killed)
    finally:
        await channel.close()
        for a in agents:
            await a.stop()
        sched.terminate()


async def _launched(agents, job_id):
    return any(launch.job_id == job_id for a in agents for launch in a.launched)


async def test_coordinator_killed_in_the_commit_leaves_the_previous_checkpoint_and_the_retry_commits(
    sqlite_url, tmp_path
):
    insert_job(sqlite_url, "ckptfault001", attempt=1, replicas=2)
    port = free_port()

    def coordinator(log, failpoints=""):
        return ServiceProcess(
            "services.checkpoint_coordinator.main",
            ["--db", sqlite_url, "--listen", f"127.0.0.1:{port}"],
            tmp_path / log,
            announce="checkpoint coordinator at",
            env={"PHALANX_FAILPOINTS": failpoints},
        )

    def rank(r):
        env = {
            "PHALANX_JOB_ID": "ckptfault001",
            "PHALANX_ATTEMPT": "1",
            "WORLD_SIZE": "2",
            "RANK": str(r),
            "PHALANX_CHECKPOINT_ADDR": f"127.0.0.1:{port}",
            "PHALANX_CHECKPOINT_DIR": str(tmp_path / "store"),
        }
        return Checkpointer(env, timeout=5.0)

    coord = coordinator("c1.log")
    try:
        r0, r1 = rank(0), rank(1)
        r0.save(5, {"step": 5, "rank": 0})
        assert r1.save(5, {"step": 5, "rank": 1}).committed
        coord.terminate()

        coord = coordinator("c2.log", failpoints="checkpoint.commit")
        r0, r1 = rank(0), rank(1)
        assert not r0.save(10, {"step": 10, "rank": 0}).committed
        with pytest.raises(CheckpointRejectedError) as err:
            r1.save(10, {"step": 10, "rank": 1})  # the coordinator dies inside this commit
        assert err.value.code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN")
        await asyncio.to_thread(coord.proc.wait, 20)
        assert coord.proc.returncode == EXIT_CODE
        engine = make_engine(sqlite_url)
        assert store.latest_checkpoint(engine, "ckptfault001").step == 5  # step 10 did not half-commit
        rows = run_sql(
            sqlite_url,
            "SELECT c.state, count(s.rank) FROM checkpoints c LEFT JOIN checkpoint_shards s "
            "ON s.checkpoint_id = c.id WHERE c.step = 10 GROUP BY c.id, c.state",
        )
        assert rows == [("PENDING", 1)]
        engine.dispose()
        coord.terminate()

        coord = coordinator("c3.log")
        r0, r1 = rank(0), rank(1)
        # gRPC shares a subchannel per address across channels: one that saw the dead coordinator may still be in
        # its reconnect backoff for a moment (a loaded machine), so the first call may be UNAVAILABLE.
        deadline = time.monotonic() + 15
        while True:
            try:
                restored = r0.restore()
                break
            except CheckpointRejectedError as exc:
                if exc.code != "UNAVAILABLE" or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert restored == (5, {"step": 5, "rank": 0})
        assert r1.save(10, {"step": 10, "rank": 1}).committed  # the rank retries its report: it commits now
        assert r0.restore() == (10, {"step": 10, "rank": 0})
        shard = (tmp_path / "store" / "ckptfault001" / "10" / "attempt-1" / "rank-1.json").read_bytes()
        assert json.loads(shard)["state"] == {"step": 10, "rank": 1}
    finally:
        coord.terminate()
