"""The ledger's identity (a cluster id written by `phalanx db upgrade`), registration returning it, the node agent
starting clean when its state directory belongs to another ledger, and a requeued job showing no allocations."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from sqlalchemy import text
from structlog.testing import capture_logs

from db.engine import make_engine
from db.migrate import cluster_id, current, head_revision, upgrade
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli.main import main
from phalanx.client import Client, JobState
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent, simple_topology
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.node_agent.state import AgentState
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

HEAD = head_revision()
OLD_JOB = "0123456789ab"


def _uuid(value: str) -> str:
    return str(uuid.UUID(value))  # raises unless it is a UUID


# -- the cluster id in the ledger ----------------------------------------------------------------------------------


def test_upgrade_writes_a_cluster_id_and_a_second_upgrade_keeps_it(empty_db_url):
    upgrade(empty_db_url)
    assert current(empty_db_url) == HEAD
    first = cluster_id(empty_db_url)
    assert first and _uuid(first) == first
    upgrade(empty_db_url)  # idempotent: the same ledger, the same id
    assert cluster_id(empty_db_url) == first
    engine = make_engine(empty_db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ledger_identity")).scalar() == 1
    engine.dispose()


def test_an_existing_ledger_upgraded_to_0015_gets_a_cluster_id_and_keeps_its_data(empty_db_url, tmp_path):
    upgrade(empty_db_url, "0014")
    assert current(empty_db_url) == "0014" and cluster_id(empty_db_url) == ""
    engine = make_engine(empty_db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO queues (name, cohort, weight, quotas, tenants, updated_at) "
                "VALUES ('q', '', 1, '{}', '[]', 0)"
            )
        )
    upgrade(empty_db_url)
    assert current(empty_db_url) == HEAD
    got = cluster_id(empty_db_url)
    assert got and _uuid(got) == got
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM queues")).all() == [("q",)]
    engine.dispose()
    other = f"sqlite:///{tmp_path / 'other.db'}"  # another ledger: another id
    upgrade(other)
    assert cluster_id(other) not in ("", got)


async def test_registration_returns_the_cluster_id_and_the_node_revision(db_url):
    upgrade(db_url)  # (the fixture's PostgreSQL tables are emptied between tests: the upgrade writes the id again)
    ledger_id = cluster_id(db_url)
    assert ledger_id
    scheduler = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["lite-0"])))
    channel = grpc.aio.insecure_channel(scheduler.address)
    try:
        stub = agent_pb2_grpc.NodeServiceStub(channel)
        req = agent_pb2.RegisterNodeRequest(
            node_name="lite-0", topology=simple_topology(2), address="127.0.0.1", agent_instance="a1"
        )
        resp = await stub.RegisterNode(req, timeout=5)
        assert resp.cluster_id == ledger_id
        assert resp.HasField("revision") and resp.revision == 0 and resp.acked_revision == 0
        jobs = scheduler_pb2_grpc.SchedulerStub(channel)
        spec = common_pb2.JobSpec(name="one", replicas=1, gpus_per_replica=1, command=["run"])
        await jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

        async def launched():
            again = await stub.RegisterNode(req, timeout=5)
            return again if again.revision >= 1 else None

        again = await eventually(launched, what="a launch revision for lite-0")
        assert again.cluster_id == ledger_id  # every registration, the same id
    finally:
        await channel.close()
        await scheduler.stop()


# -- a real agent whose state directory came from another ledger ---------------------------------------------------


def _old_ledger_state(state_dir, *, saved_cluster_id: str | None) -> subprocess.Popen:
    """A state directory as an agent of an earlier ledger left it: acked revision 50, a live adopted rank of a job
    of that ledger, a report not yet sent, a killed attempt. `saved_cluster_id` None: written by an agent of before
    cluster ids (no such key)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    status, log_file = launcher.rank_paths(state_dir, OLD_JOB, 3, 0)
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"state": "running", "wrapper_pid": proc.pid, "child_pid": proc.pid}))
    data = {
        "version": 1,
        "node_name": "node-a",
        "acked_revision": 50,
        "ranks": {
            f"{OLD_JOB}/3/0": {
                "job_id": OLD_JOB,
                "attempt": 3,
                "rank": 0,
                "gpus": [0],
                "state": "running",
                "wrapper_pid": proc.pid,
                "wrapper_start": launcher.proc_start_time(proc.pid),
                "child_pid": proc.pid,
                "status_file": str(status),
                "log_file": str(log_file),
            }
        },
        "killed_attempts": [f"{OLD_JOB}/2"],
        "pending_reports": [
            {
                "job_id": OLD_JOB,
                "attempt": 2,
                "rank": 0,
                "state": "killed",
                "exit_code": 0,
                "message": "killed",
                "pid": 1,
                "retryable": False,
            }
        ],
        "mig_created": [],
    }
    if saved_cluster_id is not None:
        data["cluster_id"] = saved_cluster_id
    (state_dir / "state.json").write_text(json.dumps(data))
    return proc


def _agent(address: str, state_dir) -> NodeAgent:
    return NodeAgent(
        AgentConfig(
            scheduler=address,
            node_name="node-a",
            topology=simulated_topology("node-a", "dgx-h100"),
            state_dir=state_dir,
            kill_grace_s=2.0,
            backoff_initial_s=0.05,
            backoff_cap_s=0.3,
            poll_interval_s=0.02,
            rpc_timeout_s=2.0,
            flush_timeout_s=2.0,
            health_enabled=False,
            simulated_nvml=nvml_for_topology,
        )
    )


@pytest.mark.parametrize("saved", ["another-ledger", "no-cluster-id"])
@pytest.mark.slow
async def test_agent_with_state_of_another_ledger_kills_its_ranks_starts_clean_and_takes_assignments(
    db_url, tmp_path, saved
):
    upgrade(db_url)
    ledger_id = cluster_id(db_url)
    old_id = str(uuid.uuid4())
    state_dir = tmp_path / "agent"
    state_dir.mkdir()
    old_rank = _old_ledger_state(state_dir, saved_cluster_id=old_id if saved == "another-ledger" else None)
    out = tmp_path / "ran.txt"
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(["node-a"]),
        heartbeat_interval=0.2,
        lease_timeout=5.0,
        launch_timeout=20.0,
        poll_interval=0.2,
    )
    scheduler = await serve(settings)
    channel = grpc.aio.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        with capture_logs() as logs:
            agent = _agent(scheduler.address, state_dir)
            task = asyncio.create_task(agent.run())
            try:
                await eventually(lambda: _registered(agent), what="agent registered")
                # Its old rank is gone: the adopted process of the other ledger was killed.
                await eventually(lambda: _dead(old_rank), what="the old ledger's rank killed", timeout=10)
                spec = common_pb2.JobSpec(
                    name="fresh",
                    replicas=1,
                    gpus_per_replica=8,
                    command=[sys.executable, "-c", f"open({str(out)!r}, 'a').write('ran\\n')"],
                )
                job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

                async def done():
                    j = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))
                    return j if j.state == common_pb2.JOB_STATE_SUCCEEDED else None

                finished = await eventually(done, timeout=15, what="the new ledger's gang succeeded")
                assert finished.attempt == 1 and out.read_text().count("ran") == 8
            finally:
                await agent.stop()
                await asyncio.wait_for(task, 10)
        warnings = [e for e in logs if e["log_level"] == "warning"]
        if saved == "another-ledger":
            (w,) = [e for e in warnings if e["event"] == "agent_state_from_another_ledger"]
            assert (w["saved_cluster_id"], w["ledger_cluster_id"]) == (old_id, ledger_id)
        else:
            (w,) = [e for e in warnings if e["event"] == "agent_state_ahead_of_ledger"]
            assert (w["saved_cluster_id"], w["ledger_cluster_id"]) == ("unknown", ledger_id)
            assert (w["saved_acked_revision"], w["ledger_revision"]) == (50, 0)
        assert any(e["event"] == "agent_state_reset" for e in warnings)
        state = AgentState.load(state_dir / "state.json")
        assert state.cluster_id == ledger_id
        # The new gang's 8 ranks ended and the scheduler took their reports: the state keeps none of them (issue 19:
        # it grows with the live ranks only), and nothing of the other ledger.
        assert not state.ranks and not state.killed_attempts and not state.pending_reports
        assert not launcher.rank_paths(state_dir, OLD_JOB, 3, 0)[0].exists()  # its status file is gone
        assert 1 <= state.acked_revision <= 3  # this ledger's revisions now
        # Nothing of the other ledger reached this one.
        rows = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000))
        assert [j.id for j in rows.jobs] == [job.id]

        # A restart against the same ledger keeps the state (no false alarm) ...
        acked = state.acked_revision
        with capture_logs() as logs:
            agent = _agent(scheduler.address, state_dir)
            task = asyncio.create_task(agent.run())
            await eventually(lambda: _registered(agent), what="agent registered again")
            await agent.stop()
            await asyncio.wait_for(task, 10)
        assert not [e for e in logs if e["event"] in ("agent_state_reset", "agent_state_from_another_ledger")]
        assert AgentState.load(state_dir / "state.json").acked_revision == acked

        # ... and so does state of an older agent (no cluster id) that is not ahead of the ledger: the id is added.
        data = json.loads((state_dir / "state.json").read_text())
        del data["cluster_id"]
        (state_dir / "state.json").write_text(json.dumps(data))
        with capture_logs() as logs:
            agent = _agent(scheduler.address, state_dir)
            task = asyncio.create_task(agent.run())
            await eventually(lambda: _registered(agent), what="agent registered a third time")
            await agent.stop()
            await asyncio.wait_for(task, 10)
        assert not [e for e in logs if e["event"] == "agent_state_reset"]
        kept = AgentState.load(state_dir / "state.json")
        assert (kept.cluster_id, kept.acked_revision) == (ledger_id, acked)
    finally:
        if old_rank.poll() is None:
            old_rank.kill()
        old_rank.wait()
        await channel.close()
        await scheduler.stop()


async def _registered(agent: NodeAgent) -> bool:
    return agent.registrations > 0 and agent._stub is not None


async def _dead(proc: subprocess.Popen) -> bool:
    return proc.poll() is not None


# -- a requeued job holds no GPUs, and shows none ------------------------------------------------------------------


async def _cli(capsys, address: str, *argv) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _sdk(address: str, job_id: str):
    with Client(address, timeout=10) as client:
        return client.get_job(job_id), {j.id: j for j in client.list_jobs()}


async def test_a_requeued_pending_job_shows_no_allocations_in_the_sdk_and_the_cli_json(db_url, capsys, service_logs):
    settings = SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        fabric=default_fabric(["node-0"]),
        heartbeat_interval=0.2,
        retry_backoff_s=120.0,
        poll_interval=0.2,
    )
    async with LiteCluster(settings, lambda address: [LiteAgent(address, "node-0")]) as c:
        address = c.scheduler.address
        # A gang whose rank exits 3 is requeued (max_restarts), and waits out a long retry backoff, PENDING.
        failing = await c.submit("fails-once", 1, 4, command=("exit", "3"), max_restarts=2)

        async def requeued():
            j = await c.job(failing.id)
            return j if j.state == common_pb2.JOB_STATE_PENDING and j.failures == 1 else None

        pending = await eventually(requeued, what="the gang requeued after its rank failed")
        assert pending.attempt == 1 and "requeued" in pending.message
        assert list(pending.allocations) == []  # GetJob
        # its first attempt's GPUs are in its history (released), not on the job
        assert c.sql(
            "SELECT count(*), count(released_at) FROM allocations WHERE job_id = :j AND attempt = 1", j=failing.id
        ) == [(4, 4)]
        # A running job, for contrast, shows the GPUs it holds.
        holder = await c.submit("holds", 1, 2)
        await c.wait_running(holder.id)

        job, listed = await asyncio.to_thread(_sdk, address, failing.id)
        assert job.state is JobState.PENDING and job.allocations == [] and job.nodes == ()
        assert listed[failing.id].allocations == []
        assert listed[holder.id].state is JobState.RUNNING and len(listed[holder.id].allocations) == 1
        assert len(listed[holder.id].allocations[0].gpus) == 2 and listed[holder.id].nodes == ("node-0",)

        code, out, err = await _cli(capsys, address, "job", failing.id, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["state"] == "PENDING" and shown["allocations"] == [] and shown["attempt"] == 1
        code, out, err = await _cli(capsys, address, "job", failing.id)
        assert code == 0, err
        assert "allocations:" not in out and "REPLICA" not in out
        code, out, err = await _cli(capsys, address, "jobs", "--json")
        assert code == 0, err
        rows = {j["id"]: j for j in json.loads(out)["jobs"]}
        assert rows[failing.id]["allocations"] == []
        assert [a["node"] for a in rows[holder.id]["allocations"]] == ["node-0"]

        # Cancelled (the reply and every read after it): no allocations either.
        code, out, err = await _cli(capsys, address, "cancel", holder.id, "--json")
        assert code == 0, err
        assert json.loads(out)["state"] == "CANCELLED" and json.loads(out)["allocations"] == []
        code, out, err = await _cli(capsys, address, "jobs", "--json")
        assert all(j["allocations"] == [] for j in json.loads(out)["jobs"])
