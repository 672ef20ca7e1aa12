"""Preemption through the scheduler service: ask the victims to checkpoint, stop them when it is committed (or the
grace period ends), hand their GPUs to the preemptor in the same commit, requeue them to resume from it."""

from __future__ import annotations

import pytest
from helpers.checkpoints import commit_checkpoint
from helpers.clock import FakeClock
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings
from services.scheduler.transitions import CycleCommand

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
PREEMPTING = common_pb2.JOB_STATE_PREEMPTING


def cluster(db_url: str, nodes: int = 2, *, min_runtime: float = 0.0, grace: float = 30.0, **kw) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(names),
        retry_backoff_s=0.1,
        preemption=PreemptionPolicy(min_runtime_s=min_runtime, grace_period_s=grace),
        preemption_poll_s=0.1,
        **kw,
    )
    return LiteCluster(settings, lambda addr: [LiteAgent(addr, n) for n in names])


async def in_state(c: LiteCluster, job_id: str, state: int, **fields):
    async def check():
        job = await c.job(job_id)
        ok = job.state == state and all(getattr(job, k) == v for k, v in fields.items())
        return job if ok else None

    return await eventually(check, timeout=15, what=f"job {job_id} {common_pb2.JobState.Name(state)} {fields}")


@pytest.mark.slow
async def test_victim_checkpoints_then_hands_its_gpus_over_in_one_commit_and_resumes_later(db_url):
    async with cluster(db_url) as c:
        low = await c.submit("low", 2, 8, priority=0)
        await c.wait_running(low.id)
        high = await c.submit("high", 1, 8, priority=100)

        victim = await in_state(c, low.id, PREEMPTING, preempted_by=high.id)
        assert victim.preempt_deadline > 0 and "asked to checkpoint" in victim.message
        waiting = await c.job(high.id)
        assert waiting.state == PENDING and low.id in waiting.message
        assert c.sql("SELECT count(*) FROM checkpoint_requests WHERE job_id = :j", j=low.id)[0][0] == 1
        assert (
            c.sql(
                "SELECT count(*) FROM allocations WHERE job_id = :j AND released_at IS NULL AND kind = 'gpu'", j=low.id
            )[0][0]
            == 16
        )  # still holds everything while it checkpoints

        commit_checkpoint(db_url, low.id, 1, 7, 16)
        await c.wait_running(high.id)
        requeued = await c.job(low.id)
        assert requeued.state == PENDING and requeued.preemptions == 1 and requeued.failures == 0
        assert requeued.not_before == 0

        # One transaction: the victim's GPUs were released at the very moment the preemptor's were reserved.
        released = c.sql("SELECT DISTINCT released_at FROM allocations WHERE job_id = :j AND attempt = 1", j=low.id)
        reserved = c.sql("SELECT DISTINCT reserved_at FROM allocations WHERE job_id = :j", j=high.id)
        assert len(released) == len(reserved) == 1 and released[0][0] == reserved[0][0]
        attempt = c.sql(
            "SELECT outcome, committed_step, kept_until IS NOT NULL, reason FROM job_attempts "
            "WHERE job_id = :j AND attempt = 1",
            j=low.id,
        )
        assert [tuple(r[:3]) for r in attempt] == [("PREEMPTED", 7, True)]
        assert f"preempted by job {high.id}" in attempt[0][3] and "checkpoint is committed" in attempt[0][3]
        killed = {(k.job_id, k.attempt) for a in c.agents for k in a.killed}
        assert (low.id, 1) in killed

        # The preemptor leaves: the victim runs again, from step 7.
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=high.id))
        resumed = await in_state(c, low.id, RUNNING, attempt=2)
        assert resumed.preemptions == 1
        assert c.sql("SELECT restored_step FROM job_attempts WHERE job_id = :j AND attempt = 2", j=low.id)[0][0] == 7


async def test_victim_without_a_checkpoint_is_stopped_when_its_grace_period_ends(db_url):
    async with cluster(db_url, grace=0.6) as c:
        low = await c.submit("low", 2, 8, priority=0)
        await c.wait_running(low.id)
        changes = c.changes()  # PREEMPTING lasts only the 0.6 s grace: seen from the change that made it
        high = await c.submit("high", 2, 8, priority=5)
        victim = await changes.until(low.id, lambda j: j.state == PREEMPTING, "the victim PREEMPTING")
        running = await c.wait_running(high.id)
        requeued = await c.job(low.id)
        assert requeued.state == PENDING and requeued.preemptions == 1
        assert "grace period" in c.sql("SELECT reason FROM job_attempts WHERE job_id = :j", j=low.id)[0][0]
        assert running.started_at >= victim.preempt_deadline - 0.01
        assert c.sql("SELECT outcome, committed_step FROM job_attempts WHERE job_id = :j", j=low.id)[0] == (
            "PREEMPTED",
            -1,
        )


async def test_zero_grace_preempts_and_places_in_the_same_cycle(db_url):
    async with cluster(db_url, grace=0.0) as c:
        low = await c.submit("low", 2, 8, priority=0)
        await c.wait_running(low.id)
        high = await c.submit("high", 2, 8, priority=5)
        assert (await c.job(high.id)).state == RUNNING  # the submit's own cycle preempted and reserved
        assert (await c.job(low.id)).state == PENDING


async def test_equal_priority_never_preempts_and_lower_never_does(db_url):
    async with cluster(db_url) as c:
        first = await c.submit("first", 2, 8, priority=10)
        await c.wait_running(first.id)
        same = await c.submit("same", 1, 8, priority=10)
        lower = await c.submit("lower", 1, 8, priority=3)
        await c.scheduler.service.execute(_Nothing())  # one more full cycle
        assert (await c.job(first.id)).state == RUNNING
        assert (await c.job(same.id)).state == PENDING and "waiting, holding no GPUs" in (await c.job(same.id)).message
        assert (await c.job(lower.id)).state == PENDING
        assert c.sql("SELECT count(*) FROM checkpoint_requests")[0][0] == 0


@pytest.mark.slow
async def test_gang_protected_by_its_minimum_runtime_is_not_preempted_until_it_ends(db_url):
    # The scheduler's clock is the test's: the protection ends when the test moves it past, not while it looks.
    clock = FakeClock()
    async with cluster(db_url, min_runtime=4.0, grace=0.0, clock=clock.time) as c:
        low = await c.submit("low", 2, 8, priority=0)
        started = (await c.wait_running(low.id)).started_at
        high = await c.submit("high", 1, 8, priority=100)
        waiting = await c.job(high.id)
        assert waiting.state == PENDING and "minimum runtime" in waiting.message
        clock.advance(3.9)
        await c.scheduler.service.execute(_Nothing())  # a whole cycle at 3.9 s: still protected
        assert (await c.job(low.id)).state == RUNNING and (await c.job(high.id)).state == PENDING
        clock.advance(0.1)
        running = await c.wait_running(high.id)  # the scheduler wakes itself when the protection ends
        assert running.started_at == pytest.approx(started + 4.0, abs=1e-6)  # at the end of the protection


async def test_cancelled_preemptor_calls_the_preemption_off(db_url):
    async with cluster(db_url) as c:
        low = await c.submit("low", 2, 8, priority=0)
        await c.wait_running(low.id)
        high = await c.submit("high", 2, 8, priority=100)
        await in_state(c, low.id, PREEMPTING)
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=high.id))
        kept = await in_state(c, low.id, RUNNING, preempted_by="")
        assert kept.attempt == 1 and kept.preemptions == 0 and "called off" in kept.message


@pytest.mark.slow
async def test_victims_are_whole_gangs_of_the_lowest_priority_first(db_url):
    async with cluster(db_url, nodes=3, grace=0.0) as c:
        batch = await c.submit("batch", 1, 8, priority=-100)
        default = await c.submit("default", 1, 8, priority=0)
        other = await c.submit("other-batch", 1, 8, priority=-100)
        for j in (batch, default, other):
            await c.wait_running(j.id)
        urgent = await c.submit("urgent", 2, 8, priority=200)
        await c.wait_running(urgent.id)
        states = {j.id: (await c.job(j.id)).state for j in (batch, default, other)}
        assert states == {batch.id: PENDING, other.id: PENDING, default.id: RUNNING}


@pytest.mark.parametrize("job_id", ["nope", "0" * 12])
async def test_checkpoint_request_errors(db_url, job_id):
    import grpc

    async with cluster(db_url) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.CheckpointJob(scheduler_pb2.CheckpointJobRequest(job_id=job_id))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        blocker = await c.submit("blocker", 2, 8, priority=1)
        await c.wait_running(blocker.id)
        pending = await c.submit("too-big", 2, 8, priority=0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.CheckpointJob(scheduler_pb2.CheckpointJobRequest(job_id=pending.id))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not running" in err.value.details()
        assert c.sql("SELECT count(*) FROM checkpoint_requests")[0][0] == 0
        ok = await c.stub.CheckpointJob(scheduler_pb2.CheckpointJobRequest(job_id=blocker.id, reason="before upgrade"))
        assert ok.reason == "before upgrade" and ok.job.id == blocker.id
        assert c.sql("SELECT reason FROM checkpoint_requests WHERE job_id = :j", j=blocker.id)[0][0] == "before upgrade"


class _Nothing(CycleCommand):
    """A command that only makes the service run a cycle."""

    def execute(self, cycle):
        return None
