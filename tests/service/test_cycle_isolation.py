"""A bug in one command, or in the scheduling pass, fails no other caller: the scheduler reloads its view (the
failed cycle may have changed it before it raised), runs each command alone without the pass, and the command at
fault alone gets an error (INTERNAL, nothing written). Before, every RPC waiting on that cycle got UNAVAILABLE, and
the view kept the failed cycle's changes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from helpers.lite_cluster import LiteCluster
from helpers.waits import next_cycle

from phalanx.api.v1 import common_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.common.errors import ServiceError
from services.scheduler import admission_lane
from services.scheduler import cycle as cycle_module
from services.scheduler.settings import SchedulerSettings
from services.scheduler.transitions import CycleCommand


@dataclass
class Broken(CycleCommand):
    """A command with a bug: it changes the view, then raises."""

    def execute(self, cycle: Any) -> Any:
        cycle.state.nodes["node-0"].gpus = 99
        raise RuntimeError("a bug in a command")


def cluster(db_url: str) -> LiteCluster:
    return LiteCluster(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"], nodes_per_leaf=4)),
        lambda address: [LiteAgent(address, "node-0", gpus=2)],
    )


async def test_a_failing_command_fails_alone_and_leaves_the_view_as_the_ledger_has_it(db_url, service_logs):
    async with cluster(db_url) as c:
        service = c.scheduler.service
        broken, submitted = await asyncio.gather(
            service.execute(Broken()), c.submit("ok", gpus=1), return_exceptions=True
        )
        assert isinstance(broken, ServiceError) and broken.code == grpc.StatusCode.INTERNAL
        assert "Traceback" not in broken.message
        assert not isinstance(submitted, BaseException), submitted
        await c.wait_running(submitted.id)
        await next_cycle(service)
        assert service.state.nodes["node-0"].gpus == 2  # reloaded: the failed cycle's change is gone
        assert "command_failed" in service_logs.text and "a bug in a command" in service_logs.text


async def test_a_failing_pass_fails_no_caller_and_scheduling_resumes_once_it_passes(db_url, monkeypatch, service_logs):
    real = cycle_module.decide
    broken = {"on": True}

    def decide(*args, **kwargs):
        if broken["on"]:
            raise RuntimeError("a bug in the pass")
        return real(*args, **kwargs)

    monkeypatch.setattr(cycle_module, "decide", decide)
    monkeypatch.setattr(admission_lane, "decide", decide)  # the decision at submit is the same core
    async with cluster(db_url) as c:
        job = await c.submit("waits", gpus=1)  # the pass fails; the submission commits all the same
        assert job.state == common_pb2.JOB_STATE_PENDING
        assert (await c.job(job.id)).state == common_pb2.JOB_STATE_PENDING
        assert "cycle_failed" in service_logs.text and "a bug in the pass" in service_logs.text
        broken["on"] = False
        await c.wait_running(job.id)
