"""A job's memory limit end to end: the real scheduler (SQLite and PostgreSQL) reserves it, the real agent puts it
on the attempt's cgroup (the cgroup v1 memory hierarchy of this host, as root), the kernel's OOM killer ends the
rank, and the job's reason says so, requeued under --max-restarts and then FAILED; `phalanx job` shows it."""

from __future__ import annotations

import asyncio
import getpass
import os
import sys
from pathlib import Path

import grpc
from helpers.procs import eventually
from helpers.required import needs
from test_node_agent import until

from db.migrate import upgrade
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli.main import main as cli_main
from phalanx.core.fabric import default_fabric
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

pytestmark = needs(
    "cgroup",
    None
    if os.geteuid() == 0 and Path("/sys/fs/cgroup/memory").is_dir()
    else "the memory limit is a cgroup's: needs root and the cgroup v1 memory hierarchy",
)

# Allocates (and touches) 200 MiB: far over a 64M limit.
HOG = [sys.executable, "-c", "import time\nb = b'x' * (200 << 20)\ntime.sleep(30)\n"]


async def test_a_rank_over_its_memory_limit_fails_the_job_saying_out_of_memory(db_url, tmp_path, capsys, service_logs):
    upgrade(db_url)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(["node-m"]),
            heartbeat_interval=0.3,
            poll_interval=0.2,
            retry_backoff_s=0.2,
            retry_backoff_max_s=0.2,
        )
    )
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name="node-m",
            topology=simulated_topology("node-m", "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=1.0,
            poll_interval_s=0.02,
            health_enabled=False,
            run_as=getpass.getuser(),
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    channel = grpc.aio.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        await until(lambda: agent.registrations >= 1, timeout=10, what="the agent registered")
        (node,) = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (node.cpus, node.memory_bytes) == (192, 2 << 40)  # the dgx-h100 profile's host
        spec = common_pb2.JobSpec(
            name="hog",
            replicas=1,
            gpus_per_replica=1,
            command=HOG,
            memory_per_replica="64M",
            cpus_per_replica=2,
            max_restarts=1,
        )
        job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

        async def job_now() -> common_pb2.Job:
            return await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))

        seen: list[str] = []

        async def failed() -> bool:
            got = await job_now()
            if got.message not in seen:
                seen.append(got.message)
            return got.state == common_pb2.JOB_STATE_FAILED

        await eventually(failed, timeout=40, what="the job failed")
        done = await job_now()
        assert done.failures == 1 and done.attempt == 2
        assert "out of memory (limit 64M)" in done.message and "after 1 restart(s)" in done.message
        assert done.exit_code == 137
        assert any("out of memory (limit 64M)" in m and "restart 1 of 1" in m for m in seen), seen
        (node,) = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (node.free_cpus, node.free_memory_bytes, node.free_gpus) == (192, 2 << 40, 8)

        capsys.readouterr()
        assert await asyncio.to_thread(cli_main, ["--scheduler", scheduler.address, "job", job.id]) == 0
        shown = capsys.readouterr().out
        assert "out of memory (limit 64M)" in shown
        assert "1 x 1 GPUs, each with 2 CPUs and 64M memory" in shown
    finally:
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 20)
        await scheduler.stop()
