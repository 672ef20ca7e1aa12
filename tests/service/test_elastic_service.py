"""Elastic gangs (`--replicas MIN:MAX`) through the scheduler service: the gang starts with what fits (at least
MIN), grows through the checkpoint handshake when capacity frees, shrinks at once when one of its nodes is lost,
and a bad range is refused before anything is written."""

from __future__ import annotations

import grpc
import pytest
from helpers.checkpoints import commit_checkpoint
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.client import Job
from phalanx.core import invariants as inv
from phalanx.core.fabric import default_fabric
from phalanx.core.snapshot import ElasticPolicy
from phalanx.testing.history import history_from_ledger
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING


def cluster(db_url: str, nodes: int = 4, **kw) -> LiteCluster:
    """Nodes of one GPU each: a replica is a node, and a rank."""
    names = [f"node-{i}" for i in range(nodes)]
    defaults = dict(
        lease_timeout=1.0,
        heartbeat_interval=0.2,
        retry_backoff_s=5.0,  # long: a shrink must not wait it out
        preemption_poll_s=0.1,
        elastic=ElasticPolicy(grow_interval_s=0.0, min_step=1, min_fraction=0.25, grace_period_s=30.0),
    )
    settings = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names), **{**defaults, **kw}
    )
    return LiteCluster(settings, lambda addr: [LiteAgent(addr, n, gpus=1) for n in names])


async def job_where(c: LiteCluster, job_id: str, what: str, check) -> common_pb2.Job:
    async def look():
        job = await c.job(job_id)
        return job if check(job) else None

    return await eventually(look, timeout=15, what=f"job {job_id}: {what}")


def assert_invariants(db_url: str) -> None:
    """The ledger's history keeps the scheduling invariants, (h) included: every elastic attempt held MIN..MAX
    whole replicas."""
    assert inv.check(history_from_ledger(db_url, grace_s=30.0), grace_s=30.0, tick_s=1.0) == []


async def launches(c: LiteCluster, job_id: str, attempt: int) -> list:
    """The launches of the attempt the agents got, once they got one: a job reads RUNNING from the commit that
    reserved it, and the agents' assignment streams deliver its launches after that."""

    async def got() -> list:
        return [x for a in c.agents for x in a.launched if x.job_id == job_id and x.attempt == attempt]

    return await eventually(got, timeout=15, what=f"a launch of {job_id} attempt {attempt} at an agent")


@pytest.mark.slow
async def test_starts_small_and_grows_through_the_checkpoint_handshake_when_another_job_ends(db_url):
    async with cluster(db_url) as c:
        other = await c.submit("other", 2, 1)
        await c.wait_running(other.id)
        gang = await c.submit("elastic", 4, 1, min_replicas=2)
        assert gang.spec.min_replicas == 2 and gang.spec.replicas == 4
        first = await job_where(c, gang.id, "running at 2", lambda j: j.state == RUNNING and j.current_replicas == 2)
        assert len(first.allocations) == 2 and "2 of at most 4" in first.placement.reason
        env = (await launches(c, gang.id, 1))[0].env
        assert (env["WORLD_SIZE"], env["PET_NNODES"], env["PHALANX_REPLICAS"]) == ("2", "2:4", "2")
        assert (env["PHALANX_MIN_REPLICAS"], env["PHALANX_MAX_REPLICAS"]) == ("2", "4")
        assert c.sql("SELECT shape FROM jobs WHERE id = :j", j=gang.id)[0][0] in (
            {"min_replicas": 2},
            '{"min_replicas": 2}',
        )

        # The other job ends: the elastic gang is asked to checkpoint for its grow (it stays RUNNING, not
        # PREEMPTING: it is its own "preemptor").
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=other.id))
        asked = await job_where(c, gang.id, "asked to grow", lambda j: j.preempted_by == gang.id)
        assert asked.state == RUNNING and asked.attempt == 1 and "growing from 2 to 4" in asked.message
        assert c.sql("SELECT count(*) FROM checkpoint_requests WHERE job_id = :j", j=gang.id)[0][0] == 1

        commit_checkpoint(db_url, gang.id, 1, 11, 2)
        grown = await job_where(c, gang.id, "running at 4", lambda j: j.state == RUNNING and j.attempt == 2)
        assert grown.current_replicas == 4 and len(grown.allocations) == 4
        assert grown.preemptions == 0 and grown.failures == 0 and not grown.preempted_by
        assert {a.node for a in first.allocations} <= {a.node for a in grown.allocations}  # kept its nodes
        assert (await launches(c, gang.id, 2))[0].env["WORLD_SIZE"] == "4"
        assert c.sql("SELECT restored_step FROM job_attempts WHERE job_id = :j AND attempt = 2", j=gang.id) == [(11,)]
        outcome = c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=gang.id)
        assert outcome == [("RESIZED",)]
        shown = Job.from_proto(grown).to_dict()
        assert (shown["min_replicas"], shown["current_replicas"], shown["replicas"]) == (2, 4, 4)
        assert_invariants(db_url)


@pytest.mark.slow
@pytest.mark.parametrize(("how", "outcome"), [("partition", "NODE_LOST"), ("drain", "NODE_DRAINED")])
async def test_shrinks_at_once_when_a_node_is_lost_or_drains(db_url, how, outcome):
    async with cluster(db_url, nodes=3) as c:
        gang = await c.submit("elastic", 3, 1, min_replicas=2)
        first = await job_where(c, gang.id, "running at 3", lambda j: j.state == RUNNING and j.current_replicas == 3)
        lost = first.allocations[-1].node
        await getattr(next(a for a in c.agents if a.name == lost), how)()  # a cut network, or an agent's SIGTERM

        shrunk = await job_where(c, gang.id, "attempt 2", lambda j: j.state == RUNNING and j.attempt == 2)
        assert shrunk.current_replicas == 2 and lost not in {a.node for a in shrunk.allocations}
        assert shrunk.failures == 0 and shrunk.not_before == 0  # no failure counted, no backoff waited
        assert (await launches(c, gang.id, 2))[0].env["WORLD_SIZE"] == "2"
        assert c.sql("SELECT outcome FROM job_attempts WHERE job_id = :j AND attempt = 1", j=gang.id) == [(outcome,)]
        assert {a.node for a in shrunk.allocations} == {a.node for a in first.allocations} - {lost}
        assert_invariants(db_url)


@pytest.mark.slow
async def test_never_below_its_minimum_it_waits_whole(db_url):
    async with cluster(db_url, nodes=3) as c:
        gang = await c.submit("elastic", 3, 1, min_replicas=2)
        first = await job_where(c, gang.id, "running at 3", lambda j: j.state == RUNNING and j.current_replicas == 3)
        for node in [a.node for a in first.allocations][:2]:  # two of three lost: one node left, below MIN
            await next(a for a in c.agents if a.name == node).partition()
        waiting = await job_where(
            c, gang.id, "waiting for its minimum", lambda j: j.state == PENDING and "minimum of 2 of 3" in j.message
        )
        assert not waiting.allocations and waiting.current_replicas == 0


@pytest.mark.parametrize(
    "spec, text_",
    [
        (dict(replicas=2, min_replicas=3), "min_replicas 3 is more than replicas 2"),
        (dict(replicas=2, min_replicas=-1), "min_replicas must be at least 1"),
        (dict(replicas=2, min_replicas=1, mig_profile="1g.10gb"), "takes whole GPUs"),
        (dict(replicas=2, min_replicas=1, gpu_milli=500), "takes whole GPUs"),
        (dict(replicas=4, min_replicas=1, segment=2), "min_replicas 1 is not a multiple of segment 2"),
        (dict(replicas=0, min_replicas=1, roles=[common_pb2.Role(name="a", replicas=2)]), "cannot have roles"),
        (dict(replicas=2, min_replicas=1, start_order="leader-first"), "starts all at once"),
    ],
)
async def test_bad_elastic_requests_are_refused_and_write_nothing(db_url, spec, text_):
    async with cluster(db_url, nodes=2) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("bad", gpus=1, **spec)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text_ in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs") == [(0,)]


async def test_a_maximum_beyond_the_cluster_is_accepted_and_runs_at_what_fits(db_url):
    async with cluster(db_url, nodes=2) as c:
        gang = await c.submit("elastic", 8, 1, min_replicas=1)
        running = await job_where(c, gang.id, "running at 2", lambda j: j.state == RUNNING and j.current_replicas == 2)
        assert running.spec.replicas == 8


@pytest.mark.slow
async def test_preemption_shrinks_an_elastic_victim_to_its_minimum(db_url):
    from phalanx.core.preemption import PreemptionPolicy

    async with cluster(db_url, preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=30.0)) as c:
        gang = await c.submit("elastic", 4, 1, min_replicas=2)
        await job_where(c, gang.id, "running at 4", lambda j: j.state == RUNNING and j.current_replicas == 4)
        urgent = await c.submit("urgent", 2, 1, priority=100)
        asked = await job_where(c, gang.id, "asked", lambda j: j.preempted_by == urgent.id)
        assert "restarts at its minimum of 2 replicas" in asked.message
        commit_checkpoint(db_url, gang.id, 1, 5, 4)
        await c.wait_running(urgent.id)
        shrunk = await job_where(c, gang.id, "attempt 2", lambda j: j.state == RUNNING and j.attempt == 2)
        assert shrunk.current_replicas == 2 and shrunk.preemptions == 1 and shrunk.failures == 0
        assert c.sql("SELECT restored_step FROM job_attempts WHERE job_id = :j AND attempt = 2", j=gang.id) == [(5,)]
        assert_invariants(db_url)
