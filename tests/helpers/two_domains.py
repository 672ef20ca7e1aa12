"""A lightweight cluster of two NVLink domains (tests of spares and spare pools): six 4-GPU nodes under one leaf,
grouped three by three, so a segment of 2 whole-node replicas and its spare fill one domain. Short leases, so a
stopped agent's node is LOST within about a second."""

from __future__ import annotations

from helpers.lite_cluster import LiteCluster

from phalanx.api.v1 import common_pb2
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
