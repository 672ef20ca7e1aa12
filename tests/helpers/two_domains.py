"""A lightweight cluster of two NVLink domains (tests of spares and spare pools): six 4-GPU nodes under one leaf,
grouped three by three, so a segment of 2 whole-node replicas and its spare fill one domain. Short leases, so a
stopped agent's node is LOST within about a second."""

from __future__ import annotations

import grpc
from helpers.lite_cluster import LiteCluster

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

RUNNING, PENDING = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PENDING
NAMES = [f"node-{i}" for i in range(6)]
FABRIC = group_nvlink_domains(default_fabric(NAMES, nodes_per_leaf=6, leaves_per_spine=1), 3)


def cluster(db_url: str, **settings) -> LiteCluster:
    """`settings`: SchedulerSettings fields beside (or instead of) these."""
    defaults = dict(lease_timeout=1.0, heartbeat_interval=0.2, retry_backoff_s=0.5, retry_backoff_max_s=5.0)
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=FABRIC, **{**defaults, **settings})
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n, gpus=4) for n in NAMES])


def agent(c: LiteCluster, name: str) -> LiteAgent:
    return next(a for a in c.agents if a.name == name)


def domain(node: str) -> str:
    return FABRIC.path(node)[0]


def nodes_of(job: common_pb2.Job) -> dict[int, str]:
    return {a.replica: a.node for a in job.allocations}


async def report_fatal_gpu(c: LiteCluster, node: str, gpu: int) -> None:
    """What a node's agent reports for an XID 79 on one GPU: that GPU FATAL, the node DEGRADED."""
    async with grpc.aio.insecure_channel(c.scheduler.address) as ch:
        health = common_pb2.NodeHealth(
            state=common_pb2.HEALTH_STATE_DEGRADED,
            reason=f"GPU {gpu}: XID 79",
            gpus=[common_pb2.GpuHealth(index=gpu, state=common_pb2.HEALTH_STATE_FATAL, reasons=["XID 79"])],
        )
        await agent_pb2_grpc.NodeServiceStub(ch).Heartbeat(agent_pb2.HeartbeatRequest(node_name=node, health=health))


async def running_attempt(c: LiteCluster, job_id: str, attempt: int) -> common_pb2.Job | None:
    """The job once its attempt `attempt` runs (None before)."""
    job = await c.job(job_id)
    return job if job.attempt == attempt and job.state == RUNNING else None
