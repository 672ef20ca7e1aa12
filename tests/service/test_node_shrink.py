"""A node that registers again with fewer GPUs (a GPU fell off the bus and its agent restarted): the scheduler takes
the hardware as it is, tears down every gang that held a GPU that is gone (whole GPUs, a share, a MIG instance),
releases their rows in the ledger (a split GPU's hold row included), and keeps scheduling.

Before the fix, a share left on a vanished GPU stayed in the capacity view; the next share placed there failed the
whole cycle with CapacityError "node-0 has no GPU 3", and every RPC waiting on a cycle got UNAVAILABLE.
"""

from __future__ import annotations

import uuid

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent, simple_topology
from services.scheduler.settings import SchedulerSettings

H100 = ("NVIDIA H100 80GB HBM3", 81559)
RUNNING, PENDING = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_PENDING


def cluster(db_url: str) -> LiteCluster:
    """One node of 5 GPUs, GPU 4 in MIG mode; a long backoff keeps the torn-down gangs waiting while the test looks."""
    return LiteCluster(
        SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(["node-0"], nodes_per_leaf=4),
            retry_backoff_s=600.0,
            retry_backoff_max_s=600.0,
        ),
        lambda address: [LiteAgent(address, "node-0", gpus=5, model=H100[0], memory_mib=H100[1], mig_gpus=(4,))],
    )


@pytest.mark.parametrize("instance", ["same", "new"])
async def test_a_node_registering_fewer_gpus_tears_down_the_gangs_on_the_vanished_ones(db_url, instance):
    async with cluster(db_url) as c:
        agent = c.agents[0]
        # One job per kind of hold, each on a known GPU: the whole-GPU gangs by index (a pair on an aligned pair),
        # the share on the GPU left outside MIG mode, the MIG instance on the GPU in MIG mode.
        keep = await c.wait_running((await c.submit("keep", gpus=1)).id)
        whole = await c.wait_running((await c.submit("whole", gpus=2)).id)
        share = await c.wait_running((await c.submit("share", gpu_milli=500)).id)
        mig = await c.wait_running((await c.submit("mig", mig_profile="3g.40gb")).id)
        assert [list(j.allocations[0].gpus) for j in (keep, whole, share, mig)] == [[0], [2, 3], [1], [4]]
        await c.settled(keep.id, whole.id, share.id, mig.id)
        assert c.sql("SELECT count(*) FROM allocations WHERE kind = 'hold' AND released_at IS NULL") == [(2,)]

        # GPUs 1 to 4 fell off the bus; the agent registers what it sees now: GPU 0.
        agent.gpus, agent.mig_gpus = 1, ()
        if instance == "new":
            agent.instance = uuid.uuid4().hex  # its heartbeats follow the new instance
        stub = agent_pb2_grpc.NodeServiceStub(c.channel)
        await stub.RegisterNode(
            agent_pb2.RegisterNodeRequest(
                node_name="node-0",
                topology=simple_topology(1, *H100),
                address="127.0.0.1",
                agent_instance=agent.instance,
            )
        )

        # Every gang that held a vanished GPU is torn down whole and requeued, and says why.
        for job, gpus in ((whole, "GPUs 2, 3"), (share, "GPU 1"), (mig, "GPU 4")):
            got = await c.job(job.id)
            assert got.state == PENDING, (job.spec.name, got.state, got.message)
            assert f"{gpus} of node-0 vanished at re-registration" in got.message, got.message
            assert "requeued" in got.message
        assert (await c.job(keep.id)).state == RUNNING  # its GPU is still there
        # Their rows are released, the split GPUs' hold rows with them: only the gang on GPU 0 holds anything.
        assert c.sql("SELECT job_id, gpu_index FROM allocations WHERE released_at IS NULL") == [(keep.id, 0)]
        (node,) = (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (node.gpus, node.free_gpus, node.shared_gpus) == (1, 0, 0)

        # The scheduler keeps working. A share waits (no GPU left for it; before the fix it went onto the vanished
        # GPU 1's half share and failed the cycle), then takes GPU 0 once the gang there ends.
        after = await c.submit("after", gpu_milli=250)
        await c.settled(keep.id)
        got = await c.job(after.id)
        assert got.state == PENDING, got.message
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=keep.id))
        after = await c.wait_running(after.id)
        assert (after.allocations[0].node, list(after.allocations[0].gpus)) == ("node-0", [0])

        # The agent got the kills of the torn-down attempts.
        async def killed():
            return {k.job_id for k in agent.killed} >= {whole.id, share.id, mig.id}

        await eventually(killed, what="the kills of the torn-down gangs")


@pytest.mark.parametrize("alive", [False, True])
async def test_a_shrunk_confirming_node_frees_the_gangs_gpus_when_its_agent_has_no_process_of_it_left(db_url, alive):
    """An agent that confirms releases: the torn-down gang's GPUs that remain stay held while the agent still runs a
    process of the attempt (it lists it in live_attempts), until it says they are gone; else they are free at once."""
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(["node-0"], nodes_per_leaf=4),
        retry_backoff_s=600.0,
        retry_backoff_max_s=600.0,
    )
    async with LiteCluster(
        settings, lambda address: [LiteAgent(address, "node-0", gpus=2, confirms_release=True)]
    ) as c:
        agent = c.agents[0]
        pair = await c.wait_running((await c.submit("pair", gpus=2)).id)
        await c.settled(pair.id)
        agent.gpus = 1
        stub = agent_pb2_grpc.NodeServiceStub(c.channel)
        await stub.RegisterNode(
            agent_pb2.RegisterNodeRequest(
                node_name="node-0",
                topology=simple_topology(1),
                address="127.0.0.1",
                agent_instance=agent.instance,
                confirms_release=True,
                live_attempts=[f"{pair.id}/{pair.attempt}"] if alive else [],
            )
        )
        got = await c.job(pair.id)
        assert got.state == PENDING and "GPU 1 of node-0 vanished at re-registration" in got.message, got.message
        held = c.sql("SELECT gpu_index FROM allocations WHERE released_at IS NULL ORDER BY gpu_index")
        assert held == ([(0,), (1,)] if alive else [])
        one = await c.submit("one", gpus=1)
        if alive:  # GPU 0 waits for the agent's word
            await c.settled()
            assert (await c.job(one.id)).state == PENDING
            resp = await stub.ReportAttemptReleased(
                agent_pb2.ReportAttemptReleasedRequest(
                    node_name="node-0", agent_instance=agent.instance, job_id=pair.id, attempt=pair.attempt
                )
            )
            assert resp.released
        one = await c.wait_running(one.id)
        assert list(one.allocations[0].gpus) == [0]
        assert c.sql("SELECT job_id, gpu_index FROM allocations WHERE released_at IS NULL") == [(one.id, 0)]
