"""An in-process scheduler (services.scheduler.main.serve) with protocol-level LiteAgents and a raw gRPC stub.

End-to-end tests that need real servers but no rank processes build on it: they give the scheduler's settings and
the agents to start, and get submit/get helpers and plain SQL on the same database.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator

import grpc
from sqlalchemy import text

from db.engine import make_engine
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

from .waits import eventually, next_cycle


class LiteCluster:
    """`async with` starts the scheduler, then `make_agents(scheduler address)`, and stops them in reverse."""

    default_command: tuple[str, ...] = ("run",)  # LiteAgent ranks of an unknown command run until killed

    def __init__(self, settings: SchedulerSettings, make_agents: Callable[[str], list[LiteAgent]]) -> None:
        self.settings = settings
        self.db_url = settings.db_url
        self._make_agents = make_agents

    async def __aenter__(self):
        self.scheduler = await serve(self.settings)
        self.agents = self._make_agents(self.scheduler.address)
        for agent in self.agents:
            await agent.start()
        self.channel = grpc.aio.insecure_channel(self.scheduler.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        for agent in self.agents:
            await agent.stop()
        await self.channel.close()
        await self.scheduler.stop()

    async def submit(self, name: str, replicas: int = 1, gpus: int = 1, command=None, **kw) -> common_pb2.Job:
        spec = common_pb2.JobSpec(
            name=name, replicas=replicas, gpus_per_replica=gpus, command=list(command or self.default_command), **kw
        )
        return await self.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, request_id=uuid.uuid4().hex))

    async def job(self, job_id: str) -> common_pb2.Job:
        return await self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))

    async def running(self, job_id: str) -> common_pb2.Job | None:
        """The job if it is RUNNING now, else None (a check for `eventually`)."""
        job = await self.job(job_id)
        return job if job.state == common_pb2.JOB_STATE_RUNNING else None

    async def wait_running(self, job_id: str, timeout: float = 15.0) -> common_pb2.Job:
        return await eventually(lambda: self.running(job_id), timeout=timeout, what=f"job {job_id} RUNNING")

    async def settled(self, *job_ids: str) -> None:
        """Wait until every rank of these running jobs has reported RUNNING to the scheduler, then for a whole cycle
        begun after that: what the scheduler decides on their start has been decided (a test asserting that nothing
        more happens, a preemption that does not come, asserts it then)."""
        service = self.scheduler.service

        async def ranks_running():
            jobs = [service.state.jobs.get(j) for j in job_ids]
            return all(j is not None and j.ranks and all(r.state == "RUNNING" for r in j.ranks.values()) for j in jobs)

        await eventually(ranks_running, what=f"the ranks of {', '.join(job_ids)} RUNNING")
        await next_cycle(service)
        await next_cycle(service)

    def sql(self, query: str, **params):
        return run_sql(self.db_url, query, **params)

    async def a_session_waits_for_a_lock(self) -> bool:
        """Whether a session of this (PostgreSQL) database waits for a lock now: a test that holds the clock row
        waits on this for the scheduler's next cycle to be blocked behind it."""
        rows = self.sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return rows[0][0] > 0

    @contextlib.contextmanager
    def holding_the_clock_row(self) -> Iterator[None]:
        """Hold the ledger's clock row (the scheduling lock) in a transaction of another session, as a long decision
        of another replica would, until the block ends (PostgreSQL): every cycle waits, the lanes do not."""
        engine = make_engine(self.db_url)
        blocker = engine.connect()
        try:
            lock = blocker.begin()
            blocker.execute(text("SELECT generation FROM ledger_clock WHERE id = 1 FOR UPDATE"))
            yield
            lock.rollback()
        finally:
            blocker.close()
            engine.dispose()

    def changes(self) -> JobChanges:
        """Every job change the scheduler commits from now on (call it before acting, to miss none)."""
        return JobChanges(self.scheduler.service)


class JobChanges:
    """The scheduler's feed of committed job changes (what WatchJobs streams), subscribed in this process: a test
    asserts a state a job passed through, however briefly, from the change that made it, instead of polling for it
    and hoping to look while it lasts."""

    def __init__(self, service) -> None:
        self._fanout = service.fanout
        self._watcher = service.fanout.subscribe(None)
        self.seen: list[common_pb2.Job] = []

    async def until(self, job_id: str, check: Callable[[common_pb2.Job], bool], what: str, timeout: float = 15.0):
        """The first change of `job_id` (since the subscription) that `check` accepts."""
        for job in self.seen:
            if job.id == job_id and check(job):
                return job

        async def next_match():
            while True:
                got = await self._watcher.get()
                assert got is not None, "the change feed overflowed"
                self.seen.append(got[0])
                if got[0].id == job_id and check(got[0]):
                    return got[0]

        try:
            return await asyncio.wait_for(next_match(), timeout)
        except TimeoutError:
            states = [common_pb2.JobState.Name(j.state) for j in self.seen if j.id == job_id]
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; the job's changes: {states}"
            ) from None

    def close(self) -> None:
        self._fanout.unsubscribe(self._watcher)


def run_sql(db_url: str, query: str, **params):
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(query), params).all()
    finally:
        engine.dispose()
