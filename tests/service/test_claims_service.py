"""Claims through the scheduler service (issue 30): a preemptor keeps what its victims free while their nodes confirm
their releases one by one, across a scheduler restart; GetJob shows the claim and what it still waits for; the
ledger keeps the claim's history and each preempted attempt's preemptor; a cancelled preemptor's claim ends."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from prometheus_client import REGISTRY

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
NAMES = ["node-01", "node-02", "node-03"]


def settings(db_url: str) -> SchedulerSettings:
    return SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(NAMES),
        preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=0.3),
        preemption_poll_s=0.1,
    )


def agents(addr: str) -> list[LiteAgent]:
    # Agents that confirm releases: a stopped gang's GPUs stay held until the test says its processes are gone.
    return [LiteAgent(addr, n, gpus=8, confirms_release=True) for n in NAMES]


async def state_of(c: LiteCluster, job_id: str) -> int:
    return (await c.job(job_id)).state


async def release(c: LiteCluster, node: str, job_id: str, attempt: int) -> None:
    """The node's agent says the attempt's processes there are gone (to the scheduler `c` runs now)."""
    agent = next(a for a in c.agents if a.name == node)
    async with grpc.aio.insecure_channel(c.scheduler.address) as channel:
        resp = await agent_pb2_grpc.NodeServiceStub(channel).ReportAttemptReleased(
            agent_pb2.ReportAttemptReleasedRequest(
                node_name=node, agent_instance=agent.instance, job_id=job_id, attempt=attempt
            )
        )
    assert resp.released


async def preempted_and_held(c: LiteCluster):
    """The issue's reproduction up to the stop: batch (2 x 8) runs, critical (3 x 8) preempts it; batch is stopped
    at the end of its grace period and its two nodes hold its GPUs."""
    batch = await c.submit("batch", 2, 8, priority=-100)
    batch = await c.wait_running(batch.id)
    nodes = sorted({a.node for a in batch.allocations})
    critical = await c.submit("critical", 3, 8, priority=200)

    async def stopped():
        job = await c.job(batch.id)
        return job if job.state == PENDING and job.preemptions == 1 else None

    await eventually(stopped, timeout=15, what="batch stopped for critical")
    held = c.sql("SELECT count(*) FROM allocations WHERE job_id = :j AND released_at IS NULL", j=batch.id)[0][0]
    assert held == 16  # its nodes confirm releases: held until they do
    return batch, critical, nodes


async def test_the_victim_stays_off_until_its_preemptor_runs_on_what_it_freed(db_url):
    async with LiteCluster(settings(db_url), agents) as c:
        batch, critical, nodes = await preempted_and_held(c)
        shown = await c.job(critical.id)
        assert shown.state == PENDING and shown.HasField("claim")
        assert shown.claim.gpus == 24 and sorted(shown.claim.nodes) == NAMES
        assert list(shown.claim.victims) == [batch.id] and not shown.claim.stopping
        assert shown.claim.releasing_gpus == 16 and "16 claimed GPU(s) still releasing" in shown.claim.waits_for
        assert "holds a claim on the 24 GPU(s) it gets and its victims free" in shown.message

        # One node confirms: 16 GPUs are free, enough for batch. It must not start there. (The release is a command
        # of a cycle, and that cycle's scheduling pass ran before the call returned.)
        await release(c, nodes[1], batch.id, 1)
        assert await state_of(c, batch.id) == PENDING
        shown = await c.job(critical.id)
        assert shown.state == PENDING and shown.claim.releasing_gpus == 8

        await release(c, nodes[0], batch.id, 1)
        running = await c.wait_running(critical.id)
        assert sorted({a.node for a in running.allocations}) == NAMES
        assert not running.HasField("claim")
        assert (await c.job(batch.id)).state == PENDING  # it resumes after critical, not before

        # The ledger: the claim's history, and the preempted attempt's preemptor.
        rows = c.sql("SELECT job_id, victims, ended_at IS NOT NULL, end_reason FROM claims")
        assert [(r[0], r[2], r[3]) for r in rows] == [(critical.id, True, "it runs")]
        assert c.sql("SELECT preempted_by FROM job_attempts WHERE job_id = :j AND attempt = 1", j=batch.id) == [
            (critical.id,)
        ]
        assert REGISTRY.get_sample_value("phalanx_job_preemptions_total", {"job": batch.id}) == 1.0


async def test_a_claim_survives_a_scheduler_restart(db_url):
    """The claim is the ledger's: a new scheduler process (a failover) loads it and keeps protecting it."""
    async with LiteCluster(settings(db_url), agents) as c:
        batch, critical, nodes = await preempted_and_held(c)
        await c.scheduler.stop()
        c.scheduler = await serve(c.settings)  # a new process's view: everything from the ledger
        await c.channel.close()
        c.channel = grpc.aio.insecure_channel(c.scheduler.address)
        c.stub = scheduler_pb2_grpc.SchedulerStub(c.channel)
        shown = await c.job(critical.id)
        assert shown.HasField("claim") and list(shown.claim.victims) == [batch.id]
        await release(c, nodes[1], batch.id, 1)
        assert await state_of(c, batch.id) == PENDING
        await release(c, nodes[0], batch.id, 1)
        await c.wait_running(critical.id)


async def test_a_cancelled_preemptor_ends_its_claim_and_the_victim_runs_again(db_url):
    async with LiteCluster(settings(db_url), agents) as c:
        batch, critical, nodes = await preempted_and_held(c)
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=critical.id))
        for node in nodes:
            await release(c, node, batch.id, 1)
        await c.wait_running(batch.id)
        rows = c.sql("SELECT end_reason FROM claims WHERE job_id = :j", j=critical.id)
        assert rows == [("cancelled",)]


@pytest.mark.parametrize("field", ["claim"])
async def test_the_cli_shows_the_claim_and_what_it_waits_for(db_url, field, capsys):
    from phalanx.cli.main import main as cli

    async with LiteCluster(settings(db_url), agents) as c:
        batch, critical, _ = await preempted_and_held(c)
        code = await asyncio.to_thread(cli, ["--scheduler", c.scheduler.address, "job", critical.id])
        out = capsys.readouterr().out
        assert code == 0 and "claim:" in out and "24 GPU(s) on node-01, node-02, node-03" in out
        assert "waits for:" in out and "16 claimed GPU(s) still releasing" in out
        code = await asyncio.to_thread(cli, ["--scheduler", c.scheduler.address, "job", critical.id, "--json"])
        shown = json.loads(capsys.readouterr().out)
        assert shown[field]["victims"] == [batch.id] and shown[field]["releasing_gpus"] == 16
        assert sorted(shown[field]) == [
            "gpus",
            "nodes",
            "releasing_gpus",
            "since",
            "stopping",
            "victims",
            "waits_for",
        ]
