"""The scheduler against a real ledger (SQLite and PostgreSQL) and real gRPC, with protocol-level agents."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from helpers.procs import eventually
from sqlalchemy import create_engine, text

from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

PENDING, RUNNING = common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    common_pb2.JOB_STATE_SUCCEEDED,
    common_pb2.JOB_STATE_FAILED,
    common_pb2.JOB_STATE_CANCELLED,
)


class Cluster:
    def __init__(self, db_url: str, nodes: int, rank_ports: tuple[int, int] = (0, 0), **settings) -> None:
        self.db_url = db_url
        self.rank_ports = rank_ports
        self.names = [f"node-{i}" for i in range(nodes)]
        self.settings = SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(self.names), **settings
        )

    async def __aenter__(self) -> Cluster:
        self.scheduler = await serve(self.settings)
        self.agents = {n: LiteAgent(self.scheduler.address, n, rank_ports=self.rank_ports) for n in self.names}
        for agent in self.agents.values():
            await agent.start()
        self.channel = grpc.aio.insecure_channel(self.scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        for agent in self.agents.values():
            await agent.stop()
        await self.channel.close()
        await self.scheduler.stop()

    async def submit(self, name, replicas, gpus, command=("sleep", "30"), priority=0, **kw) -> common_pb2.Job:
        spec = common_pb2.JobSpec(
            name=name, replicas=replicas, gpus_per_replica=gpus, command=list(command), priority=priority, **kw
        )
        return await self.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

    async def job(self, job_id: str) -> common_pb2.Job:
        return await self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))

    async def wait_state(self, job_id: str, state: int, timeout: float = 15.0) -> common_pb2.Job:
        async def check():
            job = await self.job(job_id)
            return job if job.state == state else None

        return await eventually(check, timeout=timeout, what=f"job {job_id} in {common_pb2.JobState.Name(state)}")

    def sql(self, query: str, **params):
        engine = create_engine(self.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            rows = conn.execute(text(query), params).all()
        engine.dispose()
        return rows

    def active_gpus(self, job_id: str) -> int:
        return self.sql("SELECT count(*) FROM allocations WHERE job_id = :j AND released_at IS NULL", j=job_id)[0][0]


@pytest.mark.slow
async def test_deadlock_scenario_one_gang_runs_the_other_waits_holding_nothing(db_url):
    async with Cluster(db_url, 4) as c:
        first, second = await asyncio.gather(
            c.submit("gang-a", 3, 8, ("sleep", "1.0")), c.submit("gang-b", 3, 8, ("sleep", "0.3"))
        )
        await eventually(lambda: _any_running(c, first.id, second.id), what="one gang running")
        a, b = await c.job(first.id), await c.job(second.id)
        running, waiting = (a, b) if a.state == RUNNING else (b, a)
        assert running.state == RUNNING and waiting.state == PENDING
        assert c.active_gpus(running.id) == 24
        assert c.active_gpus(waiting.id) == 0 and not waiting.allocations
        assert "holding no GPUs" in waiting.message
        done = await c.wait_state(running.id, SUCCEEDED)
        later = await c.wait_state(waiting.id, SUCCEEDED, timeout=20)
        assert later.started_at >= done.finished_at
        assert not later.allocations  # a finished job holds no GPUs; its attempt's are in the ledger's history
        assert c.sql("SELECT count(*), count(released_at) FROM allocations WHERE job_id = :j", j=later.id) == [(24, 24)]


async def _any_running(c: Cluster, *ids: str) -> bool:
    return any([(await c.job(i)).state == RUNNING for i in ids])


async def test_ranks_get_the_torchrun_environment(db_url):
    async with Cluster(db_url, 2) as c:
        job = await c.submit("env", 2, 8, ("run",))
        await c.wait_state(job.id, RUNNING)
        await eventually(lambda: _launched(c, 2), what="launches on both nodes")
        launches = [launch for a in c.agents.values() for launch in a.launched if launch.job_id == job.id]
        ranks = sorted(
            ((r, {**launch.env, **r.env}) for launch in launches for r in launch.ranks), key=lambda x: x[0].rank
        )
        assert [r.rank for r, _ in ranks] == list(range(16))
        assert len({env["MASTER_ADDR"] for _, env in ranks}) == 1
        assert len({env["MASTER_PORT"] for _, env in ranks}) == 1
        # Below the ephemeral port range, where no outgoing connection of the master's host can hold it.
        ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
        low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
        assert 1024 < int(ranks[0][1]["MASTER_PORT"]) < low
        for r, env in ranks:
            assert env["RANK"] == str(r.rank) and env["WORLD_SIZE"] == "16"
            assert env["LOCAL_RANK"] == str(r.rank % 8) and env["LOCAL_WORLD_SIZE"] == "8"
            assert env["NODE_RANK"] == str(r.rank // 8) and env["PHALANX_JOB_ID"] == job.id
            assert env["CUDA_VISIBLE_DEVICES"] == str(r.gpus[0])


async def test_gangs_whose_rank_0_shares_a_host_never_share_a_master_port(db_url):
    """Eight 1-GPU gangs on one node whose agent lets MASTER_PORT come from eight ports: each gang gets one of its
    own; a gang reserved after one of them ended gets the one freed."""
    async with Cluster(db_url, 1, rank_ports=(21000, 21007)) as c:
        jobs = [await c.submit(f"p{i}", 1, 1, ("run",)) for i in range(8)]
        for job in jobs:
            await c.wait_state(job.id, RUNNING)
        await eventually(lambda: _launched(c, 8), what="eight launches")

        def ports() -> dict[str, int]:
            return {launch.job_id: int(launch.env["MASTER_PORT"]) for a in c.agents.values() for launch in a.launched}

        assert len(set(ports().values())) == 8
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=jobs[0].id))
        late = await c.submit("late", 1, 1, ("run",))
        await c.wait_state(late.id, RUNNING)
        await eventually(lambda: _launched(c, 9), what="the late launch")
        live = {p for j, p in ports().items() if j not in (jobs[0].id, late.id)}
        assert (
            len(live) == 7
            and ports()[late.id] == ports()[jobs[0].id]
            and set(ports().values()) <= set(range(21000, 21008))
        )


async def _launched(c: Cluster, n: int) -> bool:
    return sum(len(a.launched) for a in c.agents.values()) >= n


async def test_one_process_per_replica_for_torchrun(db_url):
    async with Cluster(db_url, 2) as c:
        job = await c.submit("torchrun", 2, 8, ("run",), procs_per_replica=1)
        await c.wait_state(job.id, RUNNING)
        await eventually(lambda: _launched(c, 2), what="launches")
        ranks = [(r, {**launch.env, **r.env}) for a in c.agents.values() for launch in a.launched for r in launch.ranks]
        assert sorted(r.rank for r, _ in ranks) == [0, 1]
        assert all(env["WORLD_SIZE"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" for _, env in ranks)


@pytest.mark.parametrize(
    "spec, words",
    [
        (dict(name="x", replicas=0, gpus_per_replica=1, command=["a"]), "replicas must be at least 1"),
        (dict(name="x", replicas=1, gpus_per_replica=-2, command=["a"]), "gpus_per_replica must be at least 1"),
        (dict(name="x", replicas=1, gpus_per_replica=1, command=[]), "command must not be empty"),
        (dict(name="", replicas=1, gpus_per_replica=1, command=["a"]), "name must not be empty"),
        (dict(name="x", replicas=1, gpus_per_replica=1, command=["a"], env={"1BAD": "v"}), "not a valid variable"),
    ],
)
async def test_invalid_submissions_are_refused_and_change_nothing(db_url, spec, words):
    async with Cluster(db_url, 1) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(**spec)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 0


@pytest.mark.parametrize(
    "replicas, gpus, words",
    [(1, 16, "largest node has 8 GPUs"), (3, 8, "16 GPUs in total"), (3, 5, "at most 2 such replicas")],
)
async def test_gangs_that_can_never_fit_are_refused_at_submit(db_url, replicas, gpus, words):
    async with Cluster(db_url, 2) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("huge", replicas, gpus)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 0


@pytest.mark.parametrize("job_id", ["", "nope", "-1", "0" * 12, "ü" * 40, "x" * 5000, "' OR 1=1 --"])
async def test_unknown_job_ids_in_any_form_are_not_found(db_url, job_id):
    async with Cluster(db_url, 1) as c:
        for call in (
            c.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id)),
            c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
async def test_cancel_releases_every_gpu_and_kills_every_rank(db_url):
    async with Cluster(db_url, 2) as c:
        job = await c.submit("victim", 2, 8, ("run",))
        await c.wait_state(job.id, RUNNING)
        cancelled = await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        assert cancelled.state == CANCELLED
        assert c.active_gpus(job.id) == 0
        await eventually(lambda: _killed(c, job.id, 2), what="kill on both nodes")
        assert not (await c.job(job.id)).allocations  # a finished job shows no allocations (ledger: released)
        again = await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
        assert again.state == CANCELLED


async def _killed(c: Cluster, job_id: str, nodes: int) -> bool:
    return sum(any(k.job_id == job_id for k in a.killed) for a in c.agents.values()) >= nodes


async def test_rank_failure_fails_the_gang_and_stops_the_rest(db_url):
    async with Cluster(db_url, 2) as c:
        job = await c.submit("crash", 2, 8, ("exit", "3"))
        failed = await c.wait_state(job.id, FAILED)
        assert failed.exit_code == 3 and "exited with code 3" in failed.message
        assert c.active_gpus(job.id) == 0


@pytest.mark.slow
async def test_gang_whose_ranks_never_start_is_torn_down_whole_and_requeued(db_url):
    async with Cluster(db_url, 2, launch_timeout=0.6, max_attempts=2) as c:
        job = await c.submit("stuck", 2, 8, ("hang",))
        failed = await c.wait_state(job.id, FAILED, timeout=20)
        assert failed.attempt == 2 and "did not start" in failed.message
        rows = c.sql(
            "SELECT attempt, count(*), count(released_at) FROM allocations WHERE job_id = :j "
            "GROUP BY attempt ORDER BY attempt",
            j=job.id,
        )
        assert [tuple(r) for r in rows] == [(1, 16, 16), (2, 16, 16)]


@pytest.mark.slow
async def test_lost_node_requeues_its_gang_onto_healthy_nodes(db_url):
    async with Cluster(db_url, 3, lease_timeout=1.0, heartbeat_interval=0.2, retry_backoff_s=0.5) as c:
        job = await c.submit("survivor", 2, 8, ("run",))
        running = await c.wait_state(job.id, RUNNING)
        victim = running.allocations[0].node
        await c.agents[victim].stop()
        c.agents.pop(victim)

        async def moved():
            j = await c.job(job.id)
            return j if j.state == RUNNING and j.attempt == 2 else None

        moved_job = await eventually(moved, timeout=15, what="gang restarted elsewhere")
        assert victim not in {a.node for a in moved_job.allocations}
        nodes = {n.name: n for n in (await c.stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes}
        assert nodes[victim].state == common_pb2.NODE_STATE_LOST and "no heartbeat" in nodes[victim].message
        assert c.active_gpus(job.id) == 16


async def test_priority_then_submission_order(db_url):
    async with Cluster(db_url, 1) as c:
        blocker = await c.submit("blocker", 1, 8, ("run",))
        await c.wait_state(blocker.id, RUNNING)
        low = await c.submit("low", 1, 8, ("run",), priority=1)
        high = await c.submit("high", 1, 8, ("run",), priority=5)
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=blocker.id))
        await c.wait_state(high.id, RUNNING)
        assert (await c.job(low.id)).state == PENDING


async def test_submit_is_idempotent_per_request_id(db_url):
    async with Cluster(db_url, 1) as c:
        spec = common_pb2.JobSpec(name="once", replicas=1, gpus_per_replica=1, command=["run"])
        a = await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id="req-1"))
        b = await c.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id="req-1"))
        assert a.id == b.id
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 1


async def test_watch_streams_every_state_change(db_url):
    async with Cluster(db_url, 1) as c:
        job = await c.submit("watched", 1, 2, ("sleep", "0.2"))
        seen = []
        async for event in c.stub.WatchJobs(scheduler_pb2.WatchJobsRequest(job_ids=[job.id])):
            seen.append(event.job.state)
            if event.job.state == SUCCEEDED:
                break
        assert seen[-1] == SUCCEEDED and RUNNING in seen


async def test_list_jobs_is_newest_first_and_filters_by_state(db_url):
    async with Cluster(db_url, 1) as c:
        ids = [(await c.submit(f"j{i}", 1, 1, ("run",))).id for i in range(3)]
        jobs = (await c.stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs
        assert [j.id for j in jobs] == ids[::-1]
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=ids[1]))
        cancelled = (await c.stub.ListJobs(scheduler_pb2.ListJobsRequest(states=[CANCELLED], page_size=1000))).jobs
        assert [j.id for j in cancelled] == [ids[1]]


async def test_a_job_changed_behind_the_schedulers_back_is_not_overwritten(db_url):
    """Job writes are compare-and-set on the version the view read, written together at the end of the cycle
    (ledger.flush_job_updates). A writer outside the scheduler changes a waiting job (no generation bump): the
    cancel's cycle finds the version moved, commits nothing, reloads, and cancels the job as the ledger has it."""
    async with Cluster(db_url, 1) as c:
        hog = await c.submit("hog", 1, 8)
        await c.wait_state(hog.id, RUNNING)
        waiting = await c.submit("waiting", 1, 8)
        assert (await c.job(waiting.id)).state == PENDING
        (before,) = c.sql("SELECT version FROM jobs WHERE id = :j", j=waiting.id)[0]
        engine = create_engine(c.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET version = version + 5, priority = 7 WHERE id = :j"), dict(j=waiting.id))
        engine.dispose()
        cancelled = await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=waiting.id))
        assert cancelled.state == CANCELLED
        rows = c.sql("SELECT state, version, priority FROM jobs WHERE id = :j", j=waiting.id)
        assert [tuple(r) for r in rows] == [("CANCELLED", before + 6, 7)]  # on top of the outside write
        assert (await c.job(hog.id)).state == RUNNING


async def test_ledger_refuses_a_stale_view_and_the_scheduler_recovers_without_partial_state(db_url):
    """A writer outside the scheduler takes a GPU behind its back (no generation bump): the scheduler's view is
    stale, its reservation hits the partial unique index, nothing of that cycle commits, and after reloading it
    places the gang on GPUs that really are free."""
    async with Cluster(db_url, 1) as c:
        warm = await c.submit("warm", 1, 1, ("exit", "0"))
        await c.wait_state(warm.id, SUCCEEDED)
        engine = create_engine(c.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, state, priority, replicas, gpus_per_replica, procs_per_replica, command,"
                    " env, attempt, message, exit_code, placement, submitted_at, started_at, finished_at, version)"
                    " VALUES ('intruder0000', 'intruder', 'RUNNING', 0, 1, 1, 0, '[\"x\"]', '{}', 1, '', 0, '{}', 0, :now, 0, 0)"
                ),
                dict(now=time.time()),
            )  # started just now: within its launch deadline, it keeps GPU 0
            conn.execute(
                text(
                    "INSERT INTO allocations (job_id, attempt, replica, node_id, gpu_id, gpu_index, reserved_at)"
                    ' SELECT \'intruder0000\', 1, 0, g.node_id, g.id, g."index", 0 FROM gpus g WHERE g."index" = 0'
                )
            )
        engine.dispose()
        job = await c.submit("victim-of-stale-view", 1, 4, ("run",))
        running = await c.wait_state(job.id, RUNNING)
        assert 0 not in running.allocations[0].gpus  # GPU 0 was taken behind the scheduler's back
        assert c.active_gpus(job.id) == 4
        double = c.sql("SELECT gpu_id FROM allocations WHERE released_at IS NULL GROUP BY gpu_id HAVING count(*) > 1")
        assert double == []


async def test_cancel_of_a_finished_job_says_it_changed_nothing(db_url, capsys, service_logs):
    from phalanx.cli.main import main as cli_main

    async with Cluster(db_url, 1) as c:
        job = await c.submit("quick", 1, 1, command=("exit", "0"))
        await c.wait_state(job.id, SUCCEEDED)
        capsys.readouterr()
        code = await asyncio.to_thread(cli_main, ["--scheduler", c.scheduler.address, "cancel", job.id])
        captured = capsys.readouterr()
        assert code == 0 and "SUCCEEDED" in captured.out
        assert f"note: job {job.id} had already finished (SUCCEEDED); cancel changed nothing" in captured.err


async def test_watch_stamps_each_change_with_when_it_happened(db_url, capsys, service_logs):
    """`phalanx watch` (piped: a line per change) stamps a change with its commit time, not the time it printed;
    --json gives it as changed_at. The scheduler's clock runs an hour behind the wall's, so a stamp taken when a
    line is printed (or when the stream started) could not pass for the commit's, however soon after it came."""
    import json

    from phalanx.cli.main import main as cli_main

    def clock() -> float:
        return time.time() - 3600.0

    async with Cluster(db_url, 1, clock=clock) as c:
        done = await c.submit("done", 1, 1, command=("exit", "0"))
        done = await c.wait_state(done.id, SUCCEEDED)
        capsys.readouterr()
        code = await asyncio.to_thread(cli_main, ["--scheduler", c.scheduler.address, "watch", done.id, "--json"])
        (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert code == 0 and line["changed_at"] == done.finished_at

        live = await c.submit("live", 1, 1, command=("sleep", "0.5"))
        code = await asyncio.to_thread(cli_main, ["--scheduler", c.scheduler.address, "watch", live.id, "--json"])
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert code == 0 and [x["state"] for x in lines][-1] == "SUCCEEDED"
        stamps = [x["changed_at"] for x in lines]
        finished = await c.job(live.id)
        assert stamps == sorted(stamps) and live.submitted_at <= stamps[0]
        assert stamps[-1] == finished.finished_at  # the commit that finished it, not the print


async def test_a_split_gpus_hold_passes_to_a_job_still_on_it(db_url):
    """Two shares of one GPU: when the job that opened the GPU's hold ends, the hold passes to the other (a hold never
    carries a finished job, whose rows retention deletes), and goes with the last share."""
    async with Cluster(db_url, 1) as c:
        a = await c.submit("a", 1, 1, gpu_milli=250)
        await c.wait_state(a.id, RUNNING)
        b = await c.submit("b", 1, 1, gpu_milli=250)
        await c.wait_state(b.id, RUNNING)
        held = "SELECT job_id, gpu_milli FROM allocations WHERE kind = 'hold' AND released_at IS NULL"
        assert c.sql(held) == [(a.id, 500)]
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.id))
        assert c.sql(held) == [(b.id, 250)]
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=b.id))
        assert c.sql(held) == []
