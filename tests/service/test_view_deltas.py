"""Two replicas keep their views by deltas (ledger_changes), not full reloads; a cycle with nothing new to decide
skips the scheduling pass; an idle assignment stream reads nothing.

Both replicas run in this process on one ledger (PostgreSQL, and a SQLite file), with lightweight agents on the
leader. After a storm of submits, cancels and completions sent to both, each replica's view must equal a view
loaded whole from the ledger: jobs, allocations, ranks, nodes and free GPUs per node.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from helpers.procs import eventually
from sqlalchemy import text

from db.engine import make_engine
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler import cycle as cycle_module
from services.scheduler import ledger
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState
from services.scheduler.transitions import CycleCommand

TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_FAILED}


def _settings(db_url: str, replica: str) -> SchedulerSettings:
    return SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", replica_id=replica, leader_lease_s=30.0, poll_interval=0.2
    )


def _fresh_view(db_url: str, settings: SchedulerSettings) -> SchedulerState:
    state = SchedulerState()
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            ledger.load_state(conn, state, settings.fabric.path)
    finally:
        engine.dispose()
    return state


def _picture(state: SchedulerState) -> dict:
    """What a view holds that scheduling depends on, comparable across views."""
    cap = state.capacity
    return {
        "jobs": {
            j.id: (
                j.state,
                j.attempt,
                j.version,
                tuple(j.allocations),
                tuple(sorted((r.rank, r.node, r.state) for r in j.ranks.values())),
            )
            for j in state.jobs.values()
        },
        "nodes": {n.name: (n.state, n.revision, n.health, n.gpus) for n in state.nodes.values()},
        "free": {name: tuple(sorted(node.free)) for name, node in cap.nodes.items()},
        "free_gpus": cap.free_gpus(),
    }


class Pair:
    """A leader (A, the agents' replica) and a follower (B) on one ledger."""

    async def __aenter__(self) -> Pair:
        self.a = await serve(_settings(self.db_url, "replica-a"))
        await eventually(lambda: _async(self.a.service.leading), what="replica A to lead")
        self.b = await serve(_settings(self.db_url, "replica-b"))
        self.agents = [LiteAgent(self.a.address, f"node-{i}") for i in range(4)]
        for agent in self.agents:
            await agent.start()
        self.channels = [grpc.aio.insecure_channel(r.address) for r in (self.a, self.b)]
        self.stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self.channels]
        return self

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url

    async def __aexit__(self, *exc) -> None:
        for agent in self.agents:
            await agent.stop()
        for c in self.channels:
            await c.close()
        await self.b.stop()
        await self.a.stop()

    async def jobs(self) -> list[common_pb2.Job]:
        return list((await self.stubs[0].ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))).jobs)


async def _async(value):
    return value


async def _settled(pair: Pair, count: int) -> None:
    async def done():
        jobs = await pair.jobs()
        return len(jobs) == count and all(j.state in TERMINAL for j in jobs)

    await eventually(done, timeout=60, interval=0.2, what="every job in an end state")


async def test_followers_writes_reach_the_leader_as_deltas_and_the_views_match_the_ledger(db_url):
    rng = random.Random(3)
    async with Pair(db_url) as pair:
        a, b = pair.a.service, pair.b.service
        full_a, full_b = a.view_reloads["full"], b.view_reloads["full"]

        async def submit(i: int) -> str:
            r, g = rng.choice([(1, 1), (1, 4), (1, 8), (2, 8), (2, 4)])
            spec = common_pb2.JobSpec(
                name=f"d-{i}", replicas=r, gpus_per_replica=g, command=["sleep", f"{rng.uniform(0.05, 0.3):.2f}"]
            )
            job = await pair.stubs[i % 2].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)
            if rng.random() < 0.25:
                await asyncio.sleep(rng.uniform(0, 0.2))
                await pair.stubs[(i + 1) % 2].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
            return job.id

        await asyncio.gather(*(submit(i) for i in range(60)))
        await _settled(pair, 60)
        # Every GPU back (the cancelled gangs' kills reported), the agents' acks in; then both replicas run a cycle
        # past the last commit, and each view is compared with the ledger's.
        await eventually(lambda: _async(a.state.capacity.free_gpus() == 32), what="every GPU released")
        await _acks_in(pair)
        for service in (a, b):
            await service.execute(_Noop())
        truth = _picture(_fresh_view(db_url, a.settings))
        assert _picture(a.state) == truth
        assert _picture(b.state) == truth
        assert truth["free_gpus"] == 32 and not truth["jobs"]
        # Neither replica reloaded its whole view for the other's writes: they read ledger_changes.
        assert a.view_reloads["full"] == full_a
        assert b.view_reloads["full"] == full_b
        assert a.view_reloads["delta"] > 0 and b.view_reloads["delta"] > 0


async def test_a_running_gang_submitted_to_the_follower_is_in_both_views(db_url):
    async with Pair(db_url) as pair:
        a, b = pair.a.service, pair.b.service
        spec = common_pb2.JobSpec(name="long", replicas=2, gpus_per_replica=8, command=["run"])
        job = await pair.stubs[1].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)

        async def running():
            got = await pair.stubs[0].GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))
            return got.state == common_pb2.JOB_STATE_RUNNING

        await eventually(running, timeout=15, what="the gang RUNNING")
        await b.execute(_Noop())
        for service in (a, b):
            assert service.state.jobs[job.id].state == "RUNNING"
            assert service.state.capacity.free_gpus() == 16
        full_a = a.view_reloads["full"]
        await pair.stubs[1].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
        await a.execute(_Noop())
        assert job.id not in a.state.jobs and a.state.capacity.free_gpus() == 32
        assert a.view_reloads["full"] == full_a


async def test_missing_change_rows_fall_back_to_a_full_reload(db_url):
    async with Pair(db_url) as pair:
        a, b = pair.a.service, pair.b.service
        await b.execute(_Noop())
        engine = make_engine(db_url)
        try:
            spec = common_pb2.JobSpec(name="x", replicas=1, gpus_per_replica=1, command=["run"])
            job = await pair.stubs[1].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)
            await pair.stubs[1].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
            full_a = a.view_reloads["full"]
            with engine.begin() as conn:  # as if pruned before A read them
                conn.execute(text("DELETE FROM ledger_changes"))
                conn.execute(text("UPDATE ledger_clock SET generation = generation + 1"))
        finally:
            engine.dispose()
        await a.execute(_Noop())
        assert a.view_reloads["full"] == full_a + 1
        assert _picture(a.state) == _picture(_fresh_view(db_url, a.settings))


def test_changes_round_trip_and_merge():
    one, two = ledger.Changes(), ledger.Changes()
    one.jobs, one.nodes, one.beats, one.revisions = {"j1"}, {1}, {1: 10.0}, {1: 4}
    two.jobs, two.beats, two.revisions, two.queues, two.sched = {"j2"}, {1: 12.0, 2: 3.0}, {1: 3}, True, True
    merged = ledger.Changes()
    merged.merge_json(one.to_json())
    merged.merge_json(two.to_json())
    assert merged.jobs == {"j1", "j2"} and merged.nodes == {1}
    assert merged.beats == {1: 12.0, 2: 3.0}  # the highest value wins: the columns only grow
    assert merged.revisions == {1: 4}
    assert merged.queues and merged.sched
    assert not ledger.Changes().any and one.any


async def test_a_cycle_with_only_rank_reports_and_heartbeats_skips_the_scheduling_pass(db_url, monkeypatch):
    passes = []
    real = cycle_module.decide

    def counting(*args, **kwargs):
        passes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cycle_module, "decide", counting)
    async with Pair(db_url) as pair:
        a = pair.a.service
        spec = common_pb2.JobSpec(name="run", replicas=1, gpus_per_replica=8, command=["run"])
        job = await pair.stubs[0].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)
        big = common_pb2.JobSpec(name="big", replicas=4, gpus_per_replica=8, command=["run"])
        await pair.stubs[0].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=big), timeout=30)  # waits: too big now

        async def ranks_running():
            return all(r.state == "RUNNING" for r in a.state.jobs[job.id].ranks.values())

        await eventually(ranks_running, timeout=15, what="the ranks RUNNING")
        await _acks_in(pair)  # then two whole cycles: whatever the start and its reports made due has run
        await a.execute(_Noop())
        await a.execute(_Noop())
        before = len(passes)
        for _ in range(5):
            await a.execute(_Noop())
            for agent in pair.agents:  # heartbeats only
                a.intake.heartbeat(agent.name)
        assert len(passes) == before
        await pair.stubs[0].CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id), timeout=30)
        assert len(passes) > before  # a release: the waiting gang is looked at again


async def test_an_idle_assignment_stream_does_not_read_the_ledger(db_url, monkeypatch):
    async with Pair(db_url) as pair:
        a = pair.a.service
        reads = []
        real = a.assignments_after

        async def counting(name, after):
            reads.append(name)
            return await real(name, after)

        monkeypatch.setattr(a, "assignments_after", counting)
        # The stream decides to read the ledger just after it asks revision_of: a read it decides on is counted
        # (synchronously) before the test, on the same event loop, can see that it asked.
        looked: list[str] = []
        revision_of = a.intake.revision_of

        def counting_looks(name):
            looked.append(name)
            return revision_of(name)

        monkeypatch.setattr(a.intake, "revision_of", counting_looks)
        agent = LiteAgent(pair.a.address, "node-late")
        await agent.start()
        try:
            await eventually(lambda: _async(looked.count("node-late") >= 1), what="the stream's first look")
            assert "node-late" not in reads  # nothing newer than what it has: no catch-up read
            a.fanout.wake_node("node-late")
            await eventually(lambda: _async(looked.count("node-late") >= 2), what="the stream's look after the wake")
            assert "node-late" not in reads
            spec = common_pb2.JobSpec(name="on-late", replicas=5, gpus_per_replica=8, command=["run"])
            job = await pair.stubs[0].SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30)

            async def launched():
                return any(launch.job_id == job.id for launch in agent.launched)

            await eventually(launched, timeout=15, what="the launch to reach the late node")
        finally:
            await agent.stop()


async def _acks_in(pair: Pair) -> None:
    """Wait until replica A has every agent's ack of the last assignment it sent it."""

    async def acked():
        service = pair.a.service
        return all(
            service.intake.acked_seen.get(a.name, 0) >= service.state.nodes[a.name].revision for a in pair.agents
        )

    await eventually(acked, what="every agent's ack of its last assignment")


class _Noop(CycleCommand):
    """A command that changes nothing: it makes the replica run a cycle now (and so catch up on the ledger)."""

    def execute(self, cycle):
        return None


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
