"""The reports for the ranks of a job that ended are answered from memory (issue 35 item 3, found at size: a
cancelled 128-node gang's kills are 128 reports, and each read the ledger inside the cycle, so a burst of cancels
held the writer for seconds)."""

from __future__ import annotations

from helpers.lite_cluster import LiteCluster
from helpers.waits import next_cycle

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler import commands
from services.scheduler.settings import SchedulerSettings


def cluster(db_url: str) -> LiteCluster:
    names = ["node-0", "node-1"]
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names))
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


async def test_a_report_for_a_job_that_ended_is_stale_without_a_read_of_the_ledger(db_url, monkeypatch):
    reads: list[str] = []
    real = commands.job_row

    def counted(conn, job_id):
        reads.append(job_id)
        return real(conn, job_id)

    monkeypatch.setattr(commands, "job_row", counted)
    async with cluster(db_url) as c:
        job = await c.submit("gone", 2, 8)
        await c.settled(job.id)
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        await next_cycle(c.scheduler.service)
        assert job.id in c.scheduler.service.state.ended
        agent = c.agents[0]
        reads.clear()
        # A rank that still says it runs is told to stop; a late KILLED changes nothing; neither reads the ledger.
        assert await agent._report(job.id, 1, 0, common_pb2.RANK_STATE_RUNNING, 0) is True
        assert await agent._report(job.id, 1, 0, common_pb2.RANK_STATE_KILLED, -15) is False
        assert reads == []
        # A job this replica never saw still reads the ledger (it may be another replica's); unknown there: stale
        assert await agent._report("000000000000", 1, 0, common_pb2.RANK_STATE_RUNNING, 0) is True
        assert reads == ["000000000000"]
        assert (await c.job(job.id)).state == common_pb2.JOB_STATE_CANCELLED
