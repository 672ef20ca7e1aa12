"""Job graphs through the scheduler service (issue 34): dependencies (afterok, afternotok, afterany) hold a job until
they are met and fail it when they never can be; an array is one row until its tasks start, runs at most its
limit at once, and gives each task PHALANX_ARRAY_TASK_ID; bad input is INVALID_ARGUMENT and writes nothing."""

from __future__ import annotations

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from helpers.waits import next_cycle

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
)


def cluster(db_url: str, nodes: int = 2, **settings) -> LiteCluster:
    names = [f"node-{i}" for i in range(nodes)]
    config = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", **settings)
    return LiteCluster(config, lambda addr: [LiteAgent(addr, n) for n in names])


def dep(job_id: str, condition: str = "") -> common_pb2.Dependency:
    return common_pb2.Dependency(job_id=job_id, condition=condition)


async def ended(c: LiteCluster, job_id: str, timeout: float = 20.0) -> common_pb2.Job:
    async def check():
        job = await c.job(job_id)
        return job if job.state in (SUCCEEDED, FAILED, CANCELLED) else None

    return await eventually(check, timeout=timeout, what=f"job {job_id} ended")


async def _rows_at_least(c: LiteCluster, n: int) -> bool:
    return job_rows(c) >= n


async def gate(c: LiteCluster) -> common_pb2.Job:
    """A gang that runs until it is cancelled: the jobs after it (`any`) wait for the test to open it (`open_gate`),
    so that what they start is submitted before they end, however slow the machine."""
    return await c.submit("gate", 1, 8, ("run",))


async def open_gate(c: LiteCluster, job: common_pb2.Job) -> None:
    await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))


def job_rows(c: LiteCluster) -> int:
    ((count,),) = c.sql("SELECT count(*) FROM jobs")
    return count


async def test_a_dependent_job_runs_only_after_its_dependency_succeeded(db_url):
    async with cluster(db_url) as c:
        g = await gate(c)
        first = await c.submit("first", 1, 8, ("sleep", "0.2"), after=[dep(g.id, "any")])
        then = await c.submit("then", 1, 8, ("sleep", "0.1"), after=[dep(first.id)])
        waiting = await c.job(then.id)
        assert waiting.state == PENDING, waiting
        assert waiting.message == f"waits for job {first.id} to succeed"
        assert [d.job_id for d in waiting.waiting_for] == [first.id]
        assert [(d.job_id, d.condition) for d in waiting.spec.after] == [(first.id, "ok")]
        await open_gate(c, g)
        done_first = await ended(c, first.id)
        done_then = await ended(c, then.id)
        assert (done_first.state, done_then.state) == (SUCCEEDED, SUCCEEDED)
        assert done_then.started_at >= done_first.finished_at  # a free node all along: it waited for its dependency
        assert not done_then.waiting_for


async def test_a_dependency_that_can_never_be_met_fails_the_job_and_its_dependents(db_url):
    async with cluster(db_url) as c:
        g = await gate(c)
        bad = await c.submit("bad", 1, 8, ("exit", "3"), after=[dep(g.id, "any")])
        ok_after = await c.submit("needs-ok", 1, 8, ("sleep", "0.1"), after=[dep(bad.id, "ok")])
        chained = await c.submit("chained", 1, 8, ("sleep", "0.1"), after=[dep(ok_after.id)])
        cleanup = await c.submit("cleanup", 1, 8, ("sleep", "0.1"), after=[dep(bad.id, "notok")])
        anyway = await c.submit("anyway", 1, 8, ("sleep", "0.1"), after=[dep(bad.id, "any")])
        await open_gate(c, g)
        failed = await ended(c, ok_after.id)
        assert failed.state == FAILED and failed.message.startswith(f"dependency_failed: job {bad.id} ended FAILED")
        assert failed.started_at == 0  # it never ran
        assert (await ended(c, chained.id)).message.startswith(f"dependency_failed: job {ok_after.id} ended FAILED")
        assert (await ended(c, cleanup.id)).state == SUCCEEDED
        assert (await ended(c, anyway.id)).state == SUCCEEDED


async def test_a_dependency_on_a_job_already_ended_is_settled_at_submission(db_url):
    async with cluster(db_url) as c:
        good = await c.submit("good", 1, 8, ("sleep", "0.05"))
        await ended(c, good.id)
        after_good = await c.submit("after-good", 1, 8, ("sleep", "0.05"), after=[dep(good.id)])
        assert not after_good.waiting_for
        assert (await ended(c, after_good.id)).state == SUCCEEDED
        rows = job_rows(c)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("never", 1, 8, after=[dep(good.id, "notok")])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"job {good.id} ended SUCCEEDED" in err.value.details()
        assert job_rows(c) == rows


async def test_bad_graph_input_is_invalid_argument_and_writes_nothing(db_url):
    async with cluster(db_url, max_array_size=100) as c:
        base = await c.submit("base", 1, 8)
        rows = job_rows(c)
        cases = {
            "unknown dependency: no job with id 'nosuchjob'": dict(after=[dep("nosuchjob")]),
            "must be ok, notok or any": dict(after=[dep(base.id, "sometimes")]),
            "over the maximum array size": dict(array="0-100"),
            "is not an index": dict(array="1-x"),
            "ends before it starts": dict(array="9-3"),
            "after '%' comes": dict(array="0-9%0"),
            "at most 64 jobs": dict(after=[dep(base.id)] * 65),
        }
        for needle, fields in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.submit("bad", 1, 8, **fields)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in err.value.details(), (needle, err.value.details())
        assert job_rows(c) == rows


async def test_a_repeated_request_that_would_close_a_cycle_is_refused(db_url):
    async with cluster(db_url, nodes=1) as c:
        blocker = await c.submit("blocker", 1, 8)  # holds the only node: nothing below runs
        spec = common_pb2.JobSpec(name="a", replicas=1, gpus_per_replica=8, command=["run"], after=[dep(blocker.id)])
        a = await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id="req-a"))
        b = await c.submit("b", 1, 8, after=[dep(a.id)])
        rows = job_rows(c)
        spec.after.append(dep(b.id))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id="req-a"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"dependency cycle: job {a.id} would wait for {b.id} -> {a.id}" in err.value.details()
        del spec.after[-1]
        spec.after.append(dep(a.id))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id="req-a"))
        assert "cannot wait for itself" in err.value.details()
        assert job_rows(c) == rows


async def test_an_array_of_20_with_limit_3_runs_at_most_3_and_each_task_gets_its_index(db_url):
    async with cluster(db_url, nodes=4) as c:
        array = await c.submit("sweep", 1, 8, ("sleep", "0.2"), array="0-19%3")
        assert array.array.tasks == 20 and array.array.limit == 3 and array.spec.array == "0-19%3"
        after = await c.submit("report", 1, 8, ("sleep", "0.05"), after=[dep(array.id)])
        most = 0

        async def done():
            nonlocal most
            ((running,),) = c.sql("SELECT count(*) FROM jobs WHERE array_parent = :p AND state = 'RUNNING'", p=array.id)
            most = max(most, running)
            job = await c.job(array.id)
            return job if job.state != PENDING else None

        parent = await eventually(done, timeout=60.0, what="the array ended")
        assert parent.state == SUCCEEDED, parent.message
        assert (parent.array.succeeded, parent.array.failed, parent.array.waiting) == (20, 0, 0)
        assert most <= 3
        # At most 3 ran at once: no task started before the one 3 places earlier had ended
        tasks = c.sql(
            "SELECT array_task, started_at, finished_at, name FROM jobs WHERE array_parent = :p ORDER BY started_at",
            p=array.id,
        )
        assert sorted(t[0] for t in tasks) == list(range(20))
        assert all(name == f"sweep[{i}]" for i, _, _, name in tasks)
        for k in range(3, len(tasks)):
            assert sum(1 for t in tasks[:k] if t[2] > tasks[k][1]) < 3
        env = {
            launch.job_id: dict(launch.env)
            for agent in c.agents
            for launch in agent.launched
            if launch.job_id != after.id
        }
        assert sorted(int(e["PHALANX_ARRAY_TASK_ID"]) for e in env.values()) == list(range(20))
        assert {e["PHALANX_ARRAY_JOB_ID"] for e in env.values()} == {array.id}
        assert {e["SLURM_ARRAY_TASK_COUNT"] for e in env.values()} == {"20"}
        report = await ended(c, after.id)
        assert report.state == SUCCEEDED and report.started_at >= parent.finished_at


async def test_an_array_is_one_row_until_its_tasks_start_and_cancel_takes_its_tasks(db_url):
    async with cluster(db_url, nodes=1) as c:
        blocker = await c.submit("blocker", 1, 8)
        await c.wait_running(blocker.id)
        array = await c.submit("big", 1, 8, ("run",), array="0-9999")
        # The array's row, and one task that holds its place in the queue while none can start
        await eventually(lambda: _rows_at_least(c, 3), what="the array's first task")
        assert job_rows(c) == 3
        await next_cycle(c.scheduler.service)
        assert job_rows(c) == 3
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=blocker.id))

        async def some_running():
            rows = c.sql("SELECT id FROM jobs WHERE array_parent = :p AND state = 'RUNNING'", p=array.id)
            return rows or None

        await eventually(some_running, what="a task of the array running")
        assert job_rows(c) <= 4  # the task that runs and the next one waiting for the node: not 10,000 rows
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=array.id))
        cancelled = await ended(c, array.id)
        assert cancelled.state == CANCELLED

        async def tasks_ended():
            rows = c.sql(
                "SELECT count(*) FROM jobs WHERE array_parent = :p AND state IN ('PENDING', 'RUNNING')", p=array.id
            )
            return rows[0][0] == 0

        await eventually(tasks_ended, what="the array's tasks cancelled")


async def test_a_failed_task_fails_the_array_and_an_afternotok_job_runs(db_url):
    async with cluster(db_url) as c:
        g = await gate(c)
        array = await c.submit("flaky", 1, 8, ("exit", "1"), array="1,3,5-6", after=[dep(g.id, "any")])
        cleanup = await c.submit("cleanup", 1, 8, ("sleep", "0.05"), after=[dep(array.id, "notok")])
        await open_gate(c, g)
        parent = await ended(c, array.id)
        assert parent.state == FAILED and (parent.array.tasks, parent.array.failed) == (4, 4)
        assert (await ended(c, cleanup.id)).state == SUCCEEDED
        indices = sorted(r[0] for r in c.sql("SELECT array_task FROM jobs WHERE array_parent = :p", p=array.id))
        assert indices == [1, 3, 5, 6]


async def test_an_end_a_follower_committed_reaches_the_leaders_dependency_check(db_url):
    """Two replicas on one ledger: the follower (B) takes the submissions and the cancel that ends the dependency;
    the leader (A) hears of them as deltas (ledger_changes) and its pass resolves the dependencies and runs the
    array it never saw submitted."""

    def settings(replica: str) -> SchedulerSettings:
        return SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", replica_id=replica, leader_lease_s=30.0, poll_interval=0.2
        )

    a = await serve(settings("replica-a"))
    await eventually(lambda: _now(a.service.leading), what="replica A to lead")
    b = await serve(settings("replica-b"))
    agents = [LiteAgent(a.address, f"node-{i}") for i in range(2)]
    for agent in agents:
        await agent.start()
    channels = [grpc.aio.insecure_channel(r.address) for r in (a, b)]
    leader, follower = (scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels)
    try:

        async def submit(stub, name, command=("sleep", "0.1"), **kw):
            spec = common_pb2.JobSpec(name=name, replicas=1, gpus_per_replica=8, command=list(command), **kw)
            return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)

        async def end(job_id):
            async def check():
                job = await leader.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))
                return job if job.state in (SUCCEEDED, FAILED, CANCELLED) else None

            return await eventually(check, timeout=30, what=f"job {job_id} ended")

        blocker = await submit(leader, "blocker", ("run",))
        needs_ok = await submit(follower, "needs-ok", after=[dep(blocker.id)])
        needs_notok = await submit(follower, "needs-notok", after=[dep(blocker.id, "notok")])
        array = await submit(follower, "arr", array="0-3%1", after=[dep(blocker.id, "any")])
        await follower.CancelJob(scheduler_pb2.CancelJobRequest(job_id=blocker.id), timeout=30)
        failed = await end(needs_ok.id)
        assert failed.state == FAILED and failed.message.startswith(
            f"dependency_failed: job {blocker.id} ended CANCELLED"
        )
        assert (await end(needs_notok.id)).state == SUCCEEDED
        done = await end(array.id)
        assert done.state == SUCCEEDED and done.array.succeeded == 4
    finally:
        for agent in agents:
            await agent.stop()
        for ch in channels:
            await ch.close()
        await b.stop()
        await a.stop()


async def _now(value):
    return value
