"""CPUs and memory as scheduled resources, through the real scheduler, real gRPC and a real ledger (SQLite and
PostgreSQL): submission checks, all-or-nothing reservations, the database's guard, and the clean handover."""

from __future__ import annotations

import grpc
import pytest
from helpers.procs import eventually
from sqlalchemy import create_engine, text

from phalanx.api.v1 import agent_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

RUNNING, CANCELLED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_CANCELLED
G = 2**30


class Cluster:
    def __init__(self, db_url: str, nodes: int, cpus: float = 16, memory: int = 64 * G, **agent) -> None:
        self.db_url = db_url
        self.names = [f"node-{i}" for i in range(nodes)]
        self.settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(self.names))
        self.host = dict(cpus=cpus, memory_bytes=memory, **agent)

    async def __aenter__(self) -> Cluster:
        self.scheduler = await serve(self.settings)
        self.agents = {n: LiteAgent(self.scheduler.address, n, gpus=4, **self.host) for n in self.names}
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

    async def submit(self, name: str, replicas: int, gpus: int, **kw) -> common_pb2.Job:
        spec = common_pb2.JobSpec(name=name, replicas=replicas, gpus_per_replica=gpus, command=["sleep", "60"], **kw)
        return await self.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

    async def job(self, job_id: str) -> common_pb2.Job:
        return await self.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))

    async def nodes(self) -> dict[str, common_pb2.Node]:
        resp = await self.stub.ListNodes(scheduler_pb2.ListNodesRequest())
        return {n.name: n for n in resp.nodes}

    async def wait(self, job_id: str, state: int) -> common_pb2.Job:
        async def check():
            job = await self.job(job_id)
            return job if job.state == state else None

        return await eventually(check, timeout=15, what=f"{job_id} in {common_pb2.JobState.Name(state)}")

    def sql(self, query: str, **params):
        engine = create_engine(self.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.connect() as conn:
            rows = conn.execute(text(query), params).all()
        engine.dispose()
        return rows


async def test_bad_sizes_and_impossible_requests_are_refused_and_change_nothing(db_url):
    async with Cluster(db_url, 2, cpus=16, memory=64 * G) as c:
        for bad in ("12X", "-1G", "64 GB of RAM", "0"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.submit("bad", 1, 1, memory_per_replica=bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not a size like 512M or 64G" in err.value.details()
        for cpus in (-1.0, float("nan"), 0.0001):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.submit("bad", 1, 1, cpus_per_replica=cpus)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cpus_per_replica" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("big", 1, 1, cpus_per_replica=17)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "asks for 17 CPUs, but the most any node has is 16" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit("big", 1, 1, memory_per_replica="65G")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "64G" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # fits one node, but not 5 replicas on 2 nodes
            await c.submit("many", 5, 1, cpus_per_replica=8)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "at most 4" in err.value.details()
        assert c.sql("SELECT count(*) FROM jobs")[0][0] == 0


async def test_replicas_reserve_cpus_and_memory_with_their_gpus_and_give_them_back(db_url):
    async with Cluster(db_url, 2, cpus=16, memory=64 * G) as c:
        nodes = await c.nodes()
        assert nodes["node-0"].cpus == 16 and nodes["node-0"].memory_bytes == 64 * G
        a = await c.submit("a", 2, 1, cpus_per_replica=10, memory_per_replica="40G")
        assert a.spec.memory_per_replica == "40G" and a.spec.cpus_per_replica == 10
        a = await c.wait(a.id, RUNNING)
        # 10 CPUs each: one replica per node, although one node has the GPUs for both.
        assert sorted(al.node for al in a.allocations) == ["node-0", "node-1"]
        assert all(al.cpus == 10 and al.memory_bytes == 40 * G for al in a.allocations)
        launched = [launch for agent in c.agents.values() for launch in agent.launched if launch.job_id == a.id]
        assert [(launch.cpus, launch.memory_bytes) for launch in launched] == [(10, 40 * G)] * 2
        nodes = await c.nodes()
        assert [(n.free_cpus, n.free_memory_bytes) for n in nodes.values()] == [(6, 24 * G)] * 2
        assert c.sql("SELECT sum(cpu_used), sum(memory_used) FROM nodes")[0] == (20_000, 80 * G)

        # GPUs are free on both nodes, CPUs are not: a gang of 2 x 8 CPUs waits, and says why.
        b = await c.submit("b", 2, 1, cpus_per_replica=8)

        async def waiting():
            job = await c.job(b.id)
            return job if "8 CPUs" in job.message and "6 CPUs" in job.message else None

        b = await eventually(waiting, timeout=10, what="b waiting for CPUs")
        assert b.state == common_pb2.JOB_STATE_PENDING and not b.allocations

        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.id))
        await c.wait(b.id, RUNNING)  # a's CPUs came back
        assert c.sql("SELECT sum(cpu_used), sum(memory_used) FROM nodes")[0] == (16_000, 0)


async def test_the_ledger_refuses_a_reservation_over_a_nodes_cpus(db_url):
    """A second writer with a stale view (a scheduler replica racing) cannot overcommit a node: the guarded update
    refuses the reservation, and the transaction leaves nothing behind."""
    from sqlalchemy.exc import IntegrityError

    from db.engine import make_engine
    from services.scheduler import ledger
    from services.scheduler.state import JobRecord

    async with Cluster(db_url, 1, cpus=8) as c:
        job = await c.submit("a", 1, 1, cpus_per_replica=6)
        await c.wait(job.id, RUNNING)
        engine = make_engine(db_url)
        try:
            with engine.connect() as conn:
                with conn.begin():
                    nodes = ledger.read_node_records(conn, lambda name: ())
                rogue = JobRecord(
                    id=job.id, name="a", state="RUNNING", priority=0, replicas=1, gpus_per_replica=1,
                    procs_per_replica=0, command=["x"], env={}, submitted_at=0.0, attempt=99, cpu_milli=6000,
                    allocations=[(0, "node-0", (3,))],
                )  # fmt: skip
                with pytest.raises(IntegrityError, match="too few CPUs"), conn.begin():
                    ledger.insert_allocations(conn, [rogue], nodes, 1.0)
        finally:
            engine.dispose()
        assert c.sql("SELECT cpu_used FROM nodes")[0][0] == 6000
        assert c.sql("SELECT count(*) FROM allocations WHERE attempt = 99")[0][0] == 0


async def test_a_releasing_attempt_keeps_its_cpus_until_its_processes_are_gone(db_url):
    async with Cluster(db_url, 1, cpus=8, confirms_release=True) as c:
        a = await c.submit("a", 1, 1, cpus_per_replica=6)
        a = await c.wait(a.id, RUNNING)
        await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=a.id))
        await c.wait(a.id, CANCELLED)
        b = await c.submit("b", 1, 1, cpus_per_replica=6)
        node = (await c.nodes())["node-0"]
        assert node.releasing_gpus == 1 and node.free_cpus == 2
        job = await c.job(b.id)
        assert job.state == common_pb2.JOB_STATE_PENDING
        agent = c.agents["node-0"]
        resp = await agent.stub.ReportAttemptReleased(
            agent_pb2.ReportAttemptReleasedRequest(
                node_name="node-0", agent_instance=agent.instance, job_id=a.id, attempt=a.attempt
            )
        )
        assert resp.released
        await c.wait(b.id, RUNNING)
        assert c.sql("SELECT cpu_used FROM nodes")[0][0] == 6000


async def test_a_counter_that_drifted_is_put_right_by_a_registration(db_url):
    """Were a node's held-CPU counter ever left too high, the guard would refuse every reservation there; a
    registration (and any full reload) counts the active rows again."""
    async with Cluster(db_url, 1, cpus=8) as c:
        a = await c.submit("a", 1, 1, cpus_per_replica=2)
        await c.wait(a.id, RUNNING)
        engine = create_engine(c.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(text("UPDATE nodes SET cpu_used = 8000"))
        engine.dispose()
        agent = c.agents["node-0"]
        await agent.stop()
        await agent.start()
        assert c.sql("SELECT cpu_used FROM nodes")[0][0] == 2000
        b = await c.submit("b", 1, 1, cpus_per_replica=6)
        await c.wait(b.id, RUNNING)
