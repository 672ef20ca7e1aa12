"""Readiness probes on the node agent (issue 33): the leader's agent runs its gang's probe and reports each change.

With a real scheduler (SQLite and PostgreSQL) and a real agent on a simulated host: an HTTP probe of the leader's
server makes the job ready, then unready once it answers 503 `failure_threshold` times in a row; a command probe
runs like a rank (the leader's environment, the attempt's working directory); a cancelled attempt's probe stops.
A LiteAgent reports readiness for scheduler tests that run no probe.
With a fake NodeService: a report answered `stale` stops the probe (the ranks run on); reports made while the
scheduler is down are sent when it is back, the latest state only; a restarted agent probes on from the state it
last reported.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest
from helpers.lite_cluster import LiteCluster
from helpers.ports import reserved_port
from helpers.waits import eventually
from test_node_agent import FakeNodeService, rank_env, start_server, until

from db.migrate import upgrade
from phalanx.api.v1 import agent_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.node_agent import launcher, readiness
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

# The leader's server (replica 0; the other replicas only wait): GET /healthz answers 503 while the file argv[2]
# exists, else 200; any other path 404.
SERVER = (
    "import http.server, os, sys, time\n"
    "if os.environ.get('PHALANX_REPLICA', '0') != '0':\n"
    "    time.sleep(3600)\n"
    "    sys.exit(0)\n"
    "port, flag = int(sys.argv[1]), sys.argv[2]\n"
    "class Health(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        code = 404 if self.path != '/healthz' else 503 if os.path.exists(flag) else 200\n"
    "        self.send_response(code)\n"
    "        self.send_header('Content-Length', '0')\n"
    "        self.end_headers()\n"
    "    def log_message(self, *args):\n"
    "        pass\n"
    "http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()\n"
)
# A rank that creates $READY_FILE, then runs until killed.
MAKES_READY_FILE = [
    sys.executable,
    "-c",
    # Rank 0 only: a rank 1 that starts late under load would make the file again after a test removed it
    "import os, time\nif os.environ['RANK'] == '0':\n    open(os.environ['READY_FILE'], 'w').close()\ntime.sleep(3600)\n",
]
# A command probe: records what it ran with in $PROBE_OUT, passes while $READY_FILE exists.
PROBE = [
    sys.executable,
    "-c",
    "import json, os, sys\n"
    "seen = dict(cwd=os.getcwd(), rank=os.environ.get('RANK'), replica=os.environ.get('PHALANX_REPLICA'),\n"
    "            container=os.environ.get('PHALANX_CONTAINER', ''))\n"
    "out = os.environ['PROBE_OUT']\n"
    "json.dump(seen, open(out + '.part', 'w'))\n"
    "os.replace(out + '.part', out)\n"
    "if not os.path.exists(os.environ['READY_FILE']):\n"
    "    print('no ready file')\n"
    "    sys.exit(1)\n",
]


def record_probing(agent: NodeAgent) -> list[tuple[str, bool]]:
    """Each check's outcome ("check", passed) and each change reported ("report", ready), in order."""
    events: list[tuple[str, bool]] = []
    check, report = agent.probes.check, agent.reports.readiness

    async def checking(probe):
        passed, detail = await check(probe)
        events.append(("check", passed))
        return passed, detail

    def reporting(job_id, attempt, ready, message=""):
        events.append(("report", ready))
        report(job_id, attempt, ready, message)

    agent.probes.check = checking  # type: ignore[method-assign]
    agent.reports.readiness = reporting  # type: ignore[method-assign]
    return events


# ------------------------------------------------------------------------------------------------ real scheduler


@pytest.fixture
async def cluster(db_url, tmp_path, service_logs):
    upgrade(db_url)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-r"]), heartbeat_interval=0.3
        )
    )
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name="node-r",
            topology=simulated_topology("node-r", "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=1.0,
            poll_interval_s=0.02,
            health_enabled=False,
            run_as=getpass.getuser(),
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    await until(lambda: agent.registrations >= 1, timeout=10, what="the agent registered")
    channel = grpc.aio.insecure_channel(scheduler.address)
    try:
        yield agent, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 20)
        await scheduler.stop()


async def _submit(stub, name: str, command: list[str], probe: common_pb2.ReadyProbe, **env: str) -> common_pb2.Job:
    spec = common_pb2.JobSpec(name=name, replicas=2, gpus_per_replica=1, command=command, env=env, ready_probe=probe)
    return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))


async def _readiness(stub, job_id: str, ready: bool) -> common_pb2.Job:
    async def check():
        job = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))
        return job if job.state == common_pb2.JOB_STATE_RUNNING and job.ready == ready else None

    return await eventually(check, timeout=30, what=f"{job_id} ready={ready}")


async def test_an_http_probe_makes_the_gang_ready_then_unready_after_the_threshold(cluster, tmp_path):
    agent, stub = cluster
    events = record_probing(agent)
    port, flag = reserved_port(), tmp_path / "unhealthy"
    probe = common_pb2.ReadyProbe(http_port=port, http_path="/healthz", period_s=0.1, timeout_s=2, failure_threshold=3)
    job = await _submit(stub, "web", [sys.executable, "-c", SERVER, str(port), str(flag)], probe)

    ready = await _readiness(stub, job.id, True)
    assert ready.ready_at > 0
    assert list(agent.probes.tasks) == [f"{job.id}/1"]  # the leader's launch only, one probe
    assert agent.state.probes[f"{job.id}/1"]["ready"] is True

    flag.write_text("")  # the server answers 503 from now on
    unready = await _readiness(stub, job.id, False)
    assert "HTTP 503" in unready.message
    after_ready = events[events.index(("report", True)) + 1 :]
    fails = after_ready[: after_ready.index(("report", False))]
    assert fails[-3:] == [("check", False)] * 3 and ("check", False) not in fails[:-3]  # exactly 3 in a row

    flag.unlink()  # probing went on: healthy again, ready again
    await _readiness(stub, job.id, True)


async def test_a_command_probe_runs_like_the_leader_rank(cluster, tmp_path):
    agent, stub = cluster
    ready_file, out = tmp_path / "ready", tmp_path / "probe.json"
    probe = common_pb2.ReadyProbe(command=PROBE, period_s=0.1, timeout_s=5, failure_threshold=2)
    job = await _submit(stub, "cmd", MAKES_READY_FILE, probe, READY_FILE=str(ready_file), PROBE_OUT=str(out))

    await _readiness(stub, job.id, True)
    seen = json.loads(out.read_text())
    assert seen["rank"] == "0" and seen["replica"] == "0"  # the leader rank's environment, the job's env in it
    assert Path(seen["cwd"]) == agent.attempts.work_dir(job.id, 1)
    assert seen["container"] == agent.attempts.groups[f"{job.id}/1"].id  # in the attempt's container

    ready_file.unlink()
    unready = await _readiness(stub, job.id, False)
    assert "exit 1: no ready file" in unready.message


async def test_the_probe_of_a_cancelled_attempt_stops(cluster, tmp_path):
    agent, stub = cluster
    ready_file = tmp_path / "ready"
    probe = common_pb2.ReadyProbe(command=PROBE, period_s=0.1, timeout_s=5)
    job = await _submit(
        stub, "gone", MAKES_READY_FILE, probe, READY_FILE=str(ready_file), PROBE_OUT=str(tmp_path / "o")
    )
    await _readiness(stub, job.id, True)
    key = f"{job.id}/1"
    task = agent.probes.tasks[key]

    await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job.id))
    await until(lambda: task.done(), timeout=15, what="the probe's task ended")
    await until(lambda: key not in agent.state.probes, timeout=15, what="the probe forgotten")
    assert not agent.probes.tasks
    assert not any(r.get("kind") == "ready" for r in agent.state.pending_reports)


async def test_a_lite_agent_reports_readiness_for_scheduler_tests(db_url):
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["lite-0"]))
    async with LiteCluster(settings, lambda address: [LiteAgent(address, "lite-0")]) as c:
        probe = common_pb2.ReadyProbe(http_port=8000, http_path="/ready")
        job = await c.submit("svc", ready_probe=probe)
        await c.settled(job.id)
        agent = c.agents[0]
        assert agent.launched[0].ready_probe.http_port == 8000  # the leader's launch carries the probe
        assert not (await c.job(job.id)).ready  # no probe has passed

        async def ready_is(value: bool):
            got = await c.job(job.id)
            return got if got.ready == value else None

        assert await agent.report_readiness(job.id, 1, True) is False
        await eventually(lambda: ready_is(True), what="ready")
        assert await agent.report_readiness(job.id, 2, False) is True  # not the running attempt: stale
        assert await agent.report_readiness(job.id, 1, False, "HTTP 503") is False
        unready = await eventually(lambda: ready_is(False), what="not ready")
        assert "HTTP 503" in unready.message


# ------------------------------------------------------------------------------------------------ fake scheduler


class ReadinessService(FakeNodeService):
    def __init__(self) -> None:
        super().__init__()
        self.readiness: list[agent_pb2.ReportReadinessRequest] = []
        self.stale_ready: set[tuple[str, int]] = set()

    async def ReportReadiness(self, request, context):
        self.readiness.append(request)
        return agent_pb2.ReportReadinessResponse(stale=(request.job_id, request.attempt) in self.stale_ready)

    def ready_states(self, job_id: str) -> list[bool]:
        return [r.ready for r in self.readiness if r.job_id == job_id]

    def launch_probed(self, revision: int, job_id: str, tmp: Path, probe: common_pb2.ReadyProbe) -> None:
        env = rank_env(tmp, job_id, 0, SLEEP=3600, READY_FILE=str(tmp / f"{job_id}.ready"), PROBE_OUT=str(tmp / "o"))
        launch = agent_pb2.LaunchReplica(job_id=job_id, attempt=1, replica=0, command=MAKES_READY_FILE)
        launch.ranks.append(agent_pb2.RankLaunch(rank=0, local_rank=0, gpus=[0], env=env))
        launch.ready_probe.CopyFrom(probe)
        self.push(agent_pb2.Assignment(revision=revision, launch=launch))


@pytest.fixture
async def fake():
    servicer = ReadinessService()
    server, port = await start_server(servicer)
    servicer.server, servicer.port = server, port
    yield servicer
    await servicer.server.stop(0)


@pytest.fixture
async def agents(tmp_path):
    started: list[tuple[NodeAgent, asyncio.Task]] = []

    def start(port: int) -> NodeAgent:
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name="node-p",
                topology=simulated_topology("node-p", "dgx-h100"),
                state_dir=tmp_path / "state",
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                self_fence=False,  # a scheduler outage in a test must not stop the ranks
                simulated_nvml=nvml_for_topology,
            )
        )
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        if not task.done():
            agent.request_stop()
            await asyncio.wait_for(task, 15)


async def test_a_stale_answer_stops_the_probe_and_leaves_the_ranks(fake, agents, tmp_path):
    fake.stale_ready.add(("old", 1))
    agent = agents(fake.port)
    fake.launch_probed(1, "old", tmp_path, common_pb2.ReadyProbe(command=PROBE, period_s=0.05, timeout_s=5))
    await until(lambda: fake.ready_states("old") == [True], timeout=15, what="the first readiness report")
    await until(lambda: not agent.probes.tasks and not agent.state.probes, what="the probe stopped")
    assert agent.state.ranks["old/1/0"].state == "running" and not agent.state.ranks["old/1/0"].kill_requested


async def test_reports_wait_out_a_scheduler_outage_and_the_latest_state_wins(fake, agents, tmp_path):
    agent = agents(fake.port)
    ready_file = tmp_path / "web.ready"
    fake.launch_probed(1, "web", tmp_path, common_pb2.ReadyProbe(command=PROBE, period_s=0.05, failure_threshold=1))
    await until(lambda: fake.ready_states("web") == [True], timeout=15, what="ready reported")

    await fake.server.stop(0)  # the scheduler is down
    ready_file.unlink()

    def queued() -> list[bool]:
        return [r["ready"] for r in agent.state.pending_reports if r.get("kind") == "ready"]

    await until(lambda: queued() == [False], timeout=15, what="not-ready queued while the scheduler is down")
    ready_file.touch()
    await until(lambda: queued() == [True], timeout=15, what="ready again, replacing the unsent not-ready")

    fake.server, _ = await start_server(fake, fake.port)
    await until(lambda: not queued(), timeout=15, what="the queued readiness sent")
    assert fake.ready_states("web") == [True, True]  # the stale not-ready was never sent
    assert fake.readiness[-1].agent_instance == agent.instance


async def test_a_restarted_agent_probes_on_from_the_state_it_reported(fake, agents, tmp_path):
    first = agents(fake.port)
    fake.launch_probed(1, "svc", tmp_path, common_pb2.ReadyProbe(command=PROBE, period_s=0.05, failure_threshold=2))
    await until(lambda: fake.ready_states("svc") == [True], timeout=15, what="ready reported")
    # Crash once the agent took the answer (its queue is empty, saved): a crash between the scheduler's answer and
    # that would have the new agent send ready again (reports are delivered at least once), which this test is not
    # about.
    await until(lambda: not first.state.pending_reports, timeout=15, what="the report's answer taken")
    await first.abort()  # a crash: the rank runs on, the probe is in the state file

    second = agents(fake.port)
    await until(lambda: "svc/1" in second.probes.tasks, timeout=15, what="the probe resumed")
    (tmp_path / "svc.ready").unlink()
    await until(lambda: fake.ready_states("svc") == [True, False], timeout=15, what="not ready, from the new agent")
    assert fake.readiness[-1].agent_instance == second.instance
    assert "exit 1" in fake.readiness[-1].message


async def test_http_and_command_checks(tmp_path):
    async def answer(reader, writer):
        await reader.readline()
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await readiness.http_check("127.0.0.1", port, "/a b", 2) == (True, "HTTP 204")
    finally:
        server.close()
        await server.wait_closed()
    passed, detail = await readiness.http_check("127.0.0.1", port, "/", 2)  # nothing listens now
    assert not passed and detail.startswith(f"GET 127.0.0.1:{port}/:")

    assert await readiness.command_check([sys.executable, "-c", "pass"], {}, 5) == (True, "exit 0")
    code = "import sys; print('first'); print('last'); sys.exit(3)"
    assert await readiness.command_check([sys.executable, "-c", code], {}, 5) == (False, "exit 3: last")
    pid_file = tmp_path / "child.pid"
    spawner = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    passed, detail = await readiness.command_check([sys.executable, "-c", spawner, str(pid_file)], {}, 1.0)
    assert not passed and "did not exit within 1s" in detail
    child = int(pid_file.read_text())
    await until(lambda: not launcher.pid_alive(child), what="the probe's own child killed with its process group")


async def test_a_probe_whose_daemon_keeps_its_output_open_still_ends_at_its_timeout(tmp_path):
    # The probe starts a daemon in a session of its own (out of reach of the group kill) that keeps the probe's
    # output open. With the output on a pipe, asyncio's wait() waited for that pipe too, and the probe hung for as
    # long as the daemon lived; the readiness it should have reported never came.
    pid_file = tmp_path / "daemon.pid"
    spawner = (
        "import subprocess, sys, time\n"
        "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(d.pid))\n"
        "time.sleep(60)\n"
    )
    try:
        async with asyncio.timeout(20):  # (the hang this guards against lasted the daemon's 60 s)
            passed, detail = await readiness.command_check([sys.executable, "-c", spawner, str(pid_file)], {}, 1.0)
        assert not passed and "did not exit within 1s" in detail
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
