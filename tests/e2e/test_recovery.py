"""Crash recovery: kill -9 the scheduler with gangs running and queued; a restart loses and repeats nothing."""

from __future__ import annotations

import grpc
from helpers.ports import reserved_port
from helpers.procs import eventually, start_scheduler

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent

RUNNING, PENDING, CANCELLED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_CANCELLED


def free_port() -> int:
    return reserved_port()  # restarted on the same address: no port-0 bind may take it meanwhile


async def test_kill9_scheduler_then_restart_loses_and_duplicates_nothing(db_url, tmp_path):
    port = free_port()
    args = ("--lease-timeout", "4", "--heartbeat-interval", "0.5")
    sched = start_scheduler(db_url, tmp_path / "s1.log", *args)
    sched.terminate()
    sched = _start_on(db_url, tmp_path / "s2.log", port, *args)
    agents = [LiteAgent(sched.address, f"node-{i}") for i in range(3)]
    try:
        for a in agents:
            await a.start()
        channel = grpc.aio.insecure_channel(sched.address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        def spec(name):
            return scheduler_pb2.SubmitJobRequest(
                spec=common_pb2.JobSpec(name=name, replicas=2, gpus_per_replica=8, command=["run"])
            )

        running = await stub.SubmitJob(spec("running"))
        await eventually(lambda: _state(stub, running.id, RUNNING), what="first gang running")
        queued = await stub.SubmitJob(spec("queued"))
        await eventually(lambda: _launched(agents, running.id, 2), what="both replicas launched")

        sched.kill9()
        sched = _start_on(db_url, tmp_path / "s3.log", port, *args)

        # Agents reconnect on their own; the lease grace keeps their nodes READY meanwhile.
        jobs = (await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs
        assert sorted(j.id for j in jobs) == sorted([running.id, queued.id])
        assert {j.id: j.state for j in jobs} == {running.id: RUNNING, queued.id: PENDING}
        nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert all(n.state == common_pb2.NODE_STATE_READY for n in nodes)

        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=running.id))
        await eventually(lambda: _state(stub, queued.id, RUNNING), timeout=20, what="queued gang running")
        await eventually(lambda: _launched(agents, queued.id, 2), what="queued gang launched")
        launches = [(launch.job_id, launch.attempt, launch.replica) for a in agents for launch in a.launched]
        assert len(launches) == len(set(launches)) == 4, launches  # no rank started twice
        assert (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=running.id))).attempt == 1
        await channel.close()
    finally:
        for a in agents:
            await a.stop()
        sched.terminate()


def _start_on(db_url, log, port, *args):
    from helpers.procs import ServiceProcess

    return ServiceProcess("services.scheduler.main", ["--db", db_url, "--listen", f"127.0.0.1:{port}", *args], log)


async def _state(stub, job_id, state):
    return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).state == state


async def _launched(agents, job_id, n):
    return sum(1 for a in agents for launch in a.launched if launch.job_id == job_id) >= n
