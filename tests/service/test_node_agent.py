"""The node agent against a fake NodeService on a real grpc.aio server (127.0.0.1, port 0).

The fake records registrations, heartbeats, acks and rank reports, and pushes assignments over the stream.
Ranks are real processes (`python -c ...`) that write their environment to a file.
"""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from helpers.waits import eventually, holds

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.node_agent.state import AgentState, RankRecord, StateDirLocked

ROOT = Path(__file__).resolve().parents[2]
S = common_pb2

# A rank: writes its environment to $OUT_FILE (whole or not at all: a test polling for the file never reads half of
# it), appends a line to $COUNT_FILE (to count starts), sleeps, exits $CODE.
RANK_SCRIPT = (
    "import json, os, sys, time\n"
    "out = os.environ['OUT_FILE']\n"
    "json.dump(dict(os.environ), open(out + '.part', 'w'))\n"
    "os.replace(out + '.part', out)\n"
    "c = os.environ.get('COUNT_FILE')\n"
    "c and open(c, 'a').write('started\\n')\n"
    "time.sleep(float(os.environ.get('SLEEP', '0')))\n"
    "sys.exit(int(os.environ.get('CODE', '0')))\n"
)
RANK_CMD = [sys.executable, "-c", RANK_SCRIPT]


class FakeNodeService(agent_pb2_grpc.NodeServiceServicer):
    def __init__(self, heartbeat_ms: int = 200) -> None:
        self.heartbeat_ms = heartbeat_ms
        self.registrations: list[agent_pb2.RegisterNodeRequest] = []
        self.heartbeats = 0
        self.last_heartbeat: agent_pb2.HeartbeatRequest | None = None
        self.acks: list[int] = []
        self.reports: list[agent_pb2.ReportRankStatusRequest] = []
        self.released: list[tuple[str, int]] = []  # ReportAttemptReleased (job, attempt), in order
        self.stream_requests: list[int] = []
        self.assignments: list[agent_pb2.Assignment] = []
        self.replay_all = False  # ignore after_revision (re-deliver everything)
        self.reregister_next = False
        self.stale: set[tuple[str, int]] = set()
        self.reject: set[str] = set()  # job ids whose reports are refused with INVALID_ARGUMENT
        self._changed = asyncio.Event()

    def push(self, assignment: agent_pb2.Assignment) -> None:
        self.assignments.append(assignment)
        self._changed.set()

    def launch(
        self, revision: int, job_id: str, attempt: int, ranks: list[dict], command=None, run_as: str = ""
    ) -> None:
        msg = agent_pb2.LaunchReplica(
            job_id=job_id, attempt=attempt, replica=0, command=command or RANK_CMD, run_as=run_as
        )
        for r in ranks:
            msg.ranks.append(
                agent_pb2.RankLaunch(
                    rank=r["rank"],
                    local_rank=r.get("local_rank", r["rank"]),
                    gpus=r.get("gpus", [r["rank"]]),
                    env=r["env"],
                )
            )
        self.push(agent_pb2.Assignment(revision=revision, launch=msg))

    def kill(self, revision: int, job_id: str, attempt: int) -> None:
        self.push(
            agent_pb2.Assignment(
                revision=revision, kill=agent_pb2.KillJob(job_id=job_id, attempt=attempt, reason="test")
            )
        )

    def states(self, job_id: str, rank: int) -> list[int]:
        return [r.state for r in self.reports if r.job_id == job_id and r.rank == rank]

    def report(self, job_id: str, rank: int, state: int) -> agent_pb2.ReportRankStatusRequest | None:
        for r in self.reports:
            if r.job_id == job_id and r.rank == rank and r.state == state:
                return r
        return None

    async def RegisterNode(self, request, context):
        self.registrations.append(request)
        return agent_pb2.RegisterNodeResponse(
            heartbeat_interval_ms=self.heartbeat_ms, lease_timeout_ms=5000, acked_revision=max(self.acks, default=0)
        )

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        self.last_heartbeat = request
        rereg, self.reregister_next = self.reregister_next, False
        return agent_pb2.HeartbeatResponse(state=S.NODE_STATE_READY, reregister=rereg)

    async def StreamAssignments(self, request, context):
        self.stream_requests.append(request.after_revision)
        after = -1 if self.replay_all else request.after_revision
        sent = 0
        while True:
            while sent < len(self.assignments):
                a = self.assignments[sent]
                sent += 1
                if a.revision > after:
                    yield a
            self._changed.clear()
            await self._changed.wait()

    async def AckAssignments(self, request, context):
        self.acks.append(request.revision)
        return agent_pb2.AckAssignmentsResponse()

    async def ReportAttemptReleased(self, request, context):
        self.released.append((request.job_id, request.attempt))
        return agent_pb2.ReportAttemptReleasedResponse(released=True)

    async def ReportRankStatus(self, request, context):
        if request.job_id in self.reject:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no job {request.job_id} on this node")
        self.reports.append(request)
        return agent_pb2.ReportRankStatusResponse(stale=(request.job_id, request.attempt) in self.stale)


async def start_server(servicer: FakeNodeService, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_NodeServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"could not bind 127.0.0.1:{port}"
    await server.start()
    return server, bound


async def until(pred, timeout: float = 8.0, what: str = "condition"):
    """Poll a plain condition until it is truthy (returned); fail naming `what` after `timeout` seconds."""
    return await eventually(lambda: holds(pred), timeout=timeout, interval=0.02, what=what)


def record_takes(agent) -> list[int]:
    """The revisions of the assignments the agent handles (each appended once handled), in order."""
    taken: list[int] = []
    take = agent._take

    async def recording(stub, a):
        await take(stub, a)
        taken.append(a.revision)

    agent._take = recording
    return taken


def rank_pids(agent, job: str) -> dict[str, tuple[int, int]]:
    """(wrapper pid, command pid) of each of the job's ranks in the agent's records."""
    return {k: (r.wrapper_pid, r.child_pid) for k, r in agent.state.ranks.items() if r.job_id == job}


def exited(agent, key: str) -> bool:
    """Whether the rank's wrapper recorded its command's exit in its status file."""
    status = launcher.read_status(agent.state.ranks[key].status_file) or {}
    return status.get("state") == "exited"


def master_port_of(job: str) -> int:
    """A job's own MASTER_PORT, as the scheduler gives each live attempt whose rank 0 shares a host (the agent
    refuses a port another live attempt holds)."""
    return 21000 + int(hashlib.sha1(job.encode()).hexdigest()[:6], 16) % 8000


def rank_env(tmp: Path, job: str, rank: int, world: int = 1, **extra) -> dict:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port_of(job)),
        "CUDA_VISIBLE_DEVICES": str(rank),
        "PHALANX_JOB_ID": job,
        "OUT_FILE": str(tmp / f"{job}-r{rank}.env.json"),
        "COUNT_FILE": str(tmp / f"{job}-r{rank}.count"),
        **{k: str(v) for k, v in extra.items()},
    }


def starts(tmp: Path, job: str, rank: int) -> int:
    p = tmp / f"{job}-r{rank}.count"
    return len(p.read_text().splitlines()) if p.exists() else 0


@pytest.fixture
async def fake():
    servicer = FakeNodeService()
    server, port = await start_server(servicer)
    servicer.server, servicer.port = server, port
    yield servicer
    await servicer.server.stop(0)


def make_agent(port: int, state_dir: Path, node: str = "node-a") -> NodeAgent:
    return NodeAgent(
        AgentConfig(
            scheduler=f"127.0.0.1:{port}",
            node_name=node,
            topology=simulated_topology(node, "dgx-h100"),
            state_dir=state_dir,
            kill_grace_s=0.5,
            backoff_initial_s=0.05,
            backoff_cap_s=0.3,
            poll_interval_s=0.02,
            rpc_timeout_s=2.0,
            flush_timeout_s=2.0,
            simulated_nvml=nvml_for_topology,
        )
    )


@pytest.fixture
async def agent_factory(tmp_path):
    agents: list[tuple[NodeAgent, asyncio.Task]] = []

    def start(port: int, state_dir: Path | None = None, node: str = "node-a") -> tuple[NodeAgent, asyncio.Task]:
        agent = make_agent(port, state_dir or tmp_path / "state", node)
        task = asyncio.create_task(agent.run())
        agents.append((agent, task))
        return agent, task

    yield start
    for agent, task in agents:
        if not task.done():
            agent.request_stop()
            try:
                await asyncio.wait_for(task, 10)
            except Exception:
                task.cancel()


# ------------------------------------------------------------------------------------------------ discovery


def test_discover_json_dgx_h100():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.node_agent.main",
            "--discover",
            "--simulate",
            "dgx-h100",
            "--json",
            "--node-name",
            "n1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # stdout is pure JSON; logs went to stderr
    assert len(data["gpus"]) == 8
    for i, g in enumerate(data["gpus"]):
        assert g["index"] == i and g["name"] == "NVIDIA H100 80GB HBM3" and g["memory_mib"] == 81559
        assert g["uuid"].startswith("GPU-") and g["pci_bus_id"] and g["numa_node"] == i // 4
        assert g["nic"] == f"NIC{i}"
    assert [n["nearest_gpu"] for n in data["nics"]] == list(range(8))
    assert [n["name"] for n in data["nics"]] == [f"NIC{i}" for i in range(8)]
    for i in range(8):
        row = data["matrix"][f"GPU{i}"]
        for j in range(8):
            if i != j:
                assert row[f"GPU{j}"] == "NV18"
        assert row[f"NIC{i}"] == "PIX"
    # table form
    table = subprocess.run(
        [sys.executable, "-m", "services.node_agent.main", "--discover", "--simulate", "dgx-h100"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert table.returncode == 0 and "GPU0" in table.stdout and "NV18" in table.stdout and "mlx5_7" in table.stdout


def test_discover_without_gpu_fails_clearly():
    out = subprocess.run(
        [sys.executable, "-m", "services.node_agent.main", "--discover"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    if out.returncode == 0:
        pytest.skip("this host has NVIDIA GPUs; NVML discovery succeeded")
    assert out.returncode != 0
    assert "NVML" in out.stderr and "--simulate" in out.stderr
    assert out.stdout == ""


# ------------------------------------------------------------------------------------------------ ranks


async def test_launch_env_running_exited(fake, agent_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_TEST_INHERITED", "yes")
    agent, _ = agent_factory(fake.port)
    await until(lambda: fake.registrations, what="registration")
    reg = fake.registrations[0]
    assert reg.node_name == "node-a" and reg.address == "127.0.0.1" and len(reg.topology.gpus) == 8
    assert reg.agent_instance == agent.instance
    fake.launch(
        1,
        "job-1",
        1,
        [
            {"rank": 0, "env": rank_env(tmp_path, "job-1", 0, 2, CODE=0)},
            {"rank": 1, "env": rank_env(tmp_path, "job-1", 1, 2, CODE=3)},
        ],
    )
    await until(
        lambda: fake.report("job-1", 1, S.RANK_STATE_EXITED) and fake.report("job-1", 0, S.RANK_STATE_EXITED),
        what="both ranks EXITED",
    )
    assert 1 in fake.acks
    for rank, code in [(0, 0), (1, 3)]:
        assert fake.states("job-1", rank) == [S.RANK_STATE_RUNNING, S.RANK_STATE_EXITED]
        assert fake.report("job-1", rank, S.RANK_STATE_RUNNING).pid > 0
        assert fake.report("job-1", rank, S.RANK_STATE_EXITED).exit_code == code
        env = json.loads((tmp_path / f"job-1-r{rank}.env.json").read_text())
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["PHALANX_JOB_ID"] == "job-1"
        # Whole GPUs by UUID, in PCI bus order (issue 19): the launch said GPU `rank`.
        assert env["CUDA_VISIBLE_DEVICES"] == agent.config.topology.gpus[rank].uuid and env["MASTER_PORT"] == str(
            master_port_of("job-1")
        )
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "PHALANX_TEST_INHERITED" not in env  # a built environment: nothing of the agent's but PATH, LANG...
    # The scheduler took both ranks' ends: the state keeps neither (it grows with the live ranks only); their logs stay.
    await until(lambda: not agent.state.ranks and not agent.state.pending_reports, what="finished ranks dropped")
    await agent.state.durable()
    state = AgentState.load(tmp_path / "state" / "state.json")
    assert state.acked_revision == 1 and not state.ranks
    assert launcher.rank_paths(tmp_path / "state", "job-1", 1, 0)[1].exists()
    # heartbeats flow at the interval the scheduler asked for
    await until(lambda: fake.heartbeats >= 1, what="heartbeat")


async def test_signal_death_and_failed_to_start(fake, agent_factory, tmp_path):
    agent_factory(fake.port)
    fake.launch(
        1,
        "sig",
        1,
        [{"rank": 0, "env": rank_env(tmp_path, "sig", 0)}],
        command=[sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
    )
    fake.launch(
        2,
        "nocmd",
        1,
        [{"rank": 0, "env": rank_env(tmp_path, "nocmd", 0)}],
        command=["/nonexistent/phalanx-no-such-binary", "--x"],
    )
    await until(lambda: fake.report("sig", 0, S.RANK_STATE_EXITED), what="EXITED after signal")
    assert fake.report("sig", 0, S.RANK_STATE_EXITED).exit_code == 128 + signal.SIGKILL
    await until(lambda: fake.report("nocmd", 0, S.RANK_STATE_FAILED_TO_START), what="FAILED_TO_START")
    assert fake.states("nocmd", 0) == [S.RANK_STATE_FAILED_TO_START]
    assert "phalanx-no-such-binary" in fake.report("nocmd", 0, S.RANK_STATE_FAILED_TO_START).message


async def test_rejected_report_does_not_block_the_queue(fake, agent_factory, tmp_path):
    agent, _ = agent_factory(fake.port)
    fake.reject.add("bad")
    fake.launch(1, "bad", 1, [{"rank": 0, "env": rank_env(tmp_path, "bad", 0)}])
    await until(lambda: agent.state.ranks.get("bad/1/0") and agent.state.ranks["bad/1/0"].final, what="bad rank done")
    fake.launch(2, "good", 1, [{"rank": 0, "env": rank_env(tmp_path, "good", 0)}])
    await until(lambda: fake.report("good", 0, S.RANK_STATE_EXITED), what="later reports still delivered")
    assert not agent.state.pending_reports or all(r["job_id"] != "bad" for r in agent.state.pending_reports)


async def test_kill_and_stale(fake, agent_factory, tmp_path):
    agent_factory(fake.port)
    fake.launch(1, "long", 1, [{"rank": 0, "env": rank_env(tmp_path, "long", 0, SLEEP=60)}])
    await until(lambda: fake.report("long", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    pid = fake.report("long", 0, S.RANK_STATE_RUNNING).pid
    assert launcher.pid_alive(pid)
    fake.kill(2, "long", 1)
    await until(lambda: fake.report("long", 0, S.RANK_STATE_KILLED), what="KILLED")
    assert fake.states("long", 0) == [S.RANK_STATE_RUNNING, S.RANK_STATE_KILLED]
    assert not launcher.pid_alive(pid)
    assert 2 in fake.acks
    # A relaunch of the killed attempt is refused; the next attempt starts.
    fake.launch(3, "long", 1, [{"rank": 0, "env": rank_env(tmp_path, "long", 0, SLEEP=60)}])
    # Stale: the scheduler answers the RUNNING report of attempt 2 with stale -> the agent kills it.
    fake.stale.add(("long", 2))
    fake.launch(4, "long", 2, [{"rank": 0, "env": rank_env(tmp_path, "long", 0, SLEEP=60)}])
    await until(
        lambda: any(r.attempt == 2 and r.state == S.RANK_STATE_KILLED for r in fake.reports), what="stale rank KILLED"
    )
    # the re-sent launch of the killed attempt 1 started nothing
    assert [r.state for r in fake.reports if r.attempt == 1] == [S.RANK_STATE_RUNNING, S.RANK_STATE_KILLED]
    assert starts(tmp_path, "long", 0) <= 2


async def test_sigterm_ignoring_rank_gets_sigkill(fake, agent_factory, tmp_path):
    agent_factory(fake.port)
    cmd = [
        sys.executable,
        "-c",
        "import os, signal, time, json\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "json.dump({}, open(os.environ['OUT_FILE'], 'w'))\n"
        "time.sleep(60)\n",
    ]
    fake.launch(1, "stubborn", 1, [{"rank": 0, "env": rank_env(tmp_path, "stubborn", 0)}], command=cmd)
    await until(lambda: (tmp_path / "stubborn-r0.env.json").exists(), what="rank up")
    await until(lambda: fake.report("stubborn", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    t0 = time.monotonic()
    fake.kill(2, "stubborn", 1)
    await until(lambda: fake.report("stubborn", 0, S.RANK_STATE_KILLED), what="KILLED")
    assert time.monotonic() - t0 >= 0.4  # waited the grace period, then SIGKILL
    assert not launcher.pid_alive(fake.report("stubborn", 0, S.RANK_STATE_RUNNING).pid)


# ------------------------------------------------------------------------------------------------ reconnects


async def test_scheduler_down_then_back_resumes_and_keeps_reports(fake, agent_factory, tmp_path):
    agent, _ = agent_factory(fake.port)
    fake.launch(1, "j", 1, [{"rank": 0, "env": rank_env(tmp_path, "j", 0, SLEEP=0.6, CODE=7)}])
    await until(lambda: fake.report("j", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    await until(lambda: 1 in fake.acks, what="ack 1")
    port = fake.port
    await fake.server.stop(0)
    # the rank exits while the scheduler is down: its EXITED report waits in the queue
    await until(lambda: agent.state.ranks["j/1/0"].state == "exited", what="rank exit seen by the agent")
    assert not fake.report("j", 0, S.RANK_STATE_EXITED)
    await until(lambda: agent._attempt >= 1, what="the agent to find the scheduler gone")
    fake.server, _ = await start_server(fake, port)
    await until(lambda: len(fake.registrations) >= 2, what="re-registration")
    assert fake.registrations[1].agent_instance == fake.registrations[0].agent_instance
    await until(lambda: len(fake.stream_requests) >= 2, what="stream resumed")
    assert fake.stream_requests[-1] == 1  # resumed after the acked revision
    await until(lambda: fake.report("j", 0, S.RANK_STATE_EXITED), what="queued EXITED delivered")
    assert fake.report("j", 0, S.RANK_STATE_EXITED).exit_code == 7
    assert fake.states("j", 0) == [S.RANK_STATE_RUNNING, S.RANK_STATE_EXITED]
    # new work after the reconnect flows
    fake.launch(2, "j2", 1, [{"rank": 0, "env": rank_env(tmp_path, "j2", 0)}])
    await until(lambda: fake.report("j2", 0, S.RANK_STATE_EXITED), what="j2 EXITED")
    assert starts(tmp_path, "j", 0) == 1


async def test_redelivery_after_reconnect_starts_nothing_twice(fake, agent_factory, tmp_path):
    agent, _ = agent_factory(fake.port)
    taken = record_takes(agent)
    ranks = [{"rank": r, "env": rank_env(tmp_path, "dup", r, 2, SLEEP=60)} for r in range(2)]
    fake.launch(1, "dup", 1, ranks)
    await until(
        lambda: fake.report("dup", 0, S.RANK_STATE_RUNNING) and fake.report("dup", 1, S.RANK_STATE_RUNNING),
        what="RUNNING",
    )
    await until(lambda: starts(tmp_path, "dup", 0) == starts(tmp_path, "dup", 1) == 1, what="both starts recorded")
    pids = rank_pids(agent, "dup")
    port = fake.port
    await fake.server.stop(0)
    fake.replay_all = True  # a scheduler that re-sends everything, same revision and a new one
    fake.launch(2, "dup", 1, ranks)
    fake.server, _ = await start_server(fake, port)
    await until(lambda: 2 in fake.acks, what="ack of the re-delivered launch")
    await until(lambda: taken.count(1) >= 2, what="revision 1 taken again")
    # Both launches handled (a rank is started before its launch is acked): the ranks are still the first processes.
    assert rank_pids(agent, "dup") == pids
    assert starts(tmp_path, "dup", 0) == 1 and starts(tmp_path, "dup", 1) == 1
    assert fake.states("dup", 0) == [S.RANK_STATE_RUNNING]
    # a heartbeat answered `reregister` makes the agent register again, still without double starts
    n, seen = len(fake.registrations), len(taken)
    fake.reregister_next = True
    await until(lambda: len(fake.registrations) > n, what="re-registration after reregister")
    await until(lambda: {1, 2} <= set(taken[seen:]), what="both launches re-sent and taken after it")
    assert rank_pids(agent, "dup") == pids and starts(tmp_path, "dup", 0) == 1
    fake.kill(3, "dup", 1)
    await until(
        lambda: fake.report("dup", 1, S.RANK_STATE_KILLED) and fake.report("dup", 0, S.RANK_STATE_KILLED), what="KILLED"
    )


# ------------------------------------------------------------------------------------------------ restarts


async def test_agent_restart_adopts_live_rank(fake, agent_factory, tmp_path):
    state_dir = tmp_path / "state"
    a, _ = agent_factory(fake.port, state_dir)
    fake.launch(1, "live", 1, [{"rank": 0, "env": rank_env(tmp_path, "live", 0, SLEEP=60)}])
    fake.launch(2, "short", 1, [{"rank": 0, "env": rank_env(tmp_path, "short", 0, SLEEP=0.3, CODE=5)}])
    await until(
        lambda: fake.report("live", 0, S.RANK_STATE_RUNNING) and fake.report("short", 0, S.RANK_STATE_RUNNING),
        what="RUNNING",
    )
    await until(lambda: 2 in fake.acks, what="acks")
    await until(lambda: starts(tmp_path, "live", 0) == 1, what="live's start recorded")
    await a.abort()  # crash: ranks keep running, nothing reported
    live_pid = fake.report("live", 0, S.RANK_STATE_RUNNING).pid
    assert launcher.pid_alive(live_pid)
    # a rank the dead agent had started whose process is gone without a trace -> LOST
    st = AgentState.load(state_dir / "state.json")
    st.ranks["ghost/1/0"] = RankRecord(
        job_id="ghost",
        attempt=1,
        rank=0,
        state="running",
        wrapper_pid=2**22 - 7,
        wrapper_start=1,
        status_file=str(tmp_path / "nope.json"),
    )
    st.save()
    await until(lambda: exited(a, "short/1/0"), what="'short' to exit while no agent runs")
    b, _ = agent_factory(fake.port, state_dir)
    assert b.instance != a.instance
    await until(lambda: fake.report("ghost", 0, S.RANK_STATE_LOST), what="ghost LOST")
    await until(lambda: fake.report("short", 0, S.RANK_STATE_EXITED), what="short EXITED from its status file")
    assert fake.report("short", 0, S.RANK_STATE_EXITED).exit_code == 5
    await until(lambda: len(fake.stream_requests) >= 2, what="resumed stream")
    assert fake.stream_requests[-1] == 2
    assert fake.registrations[-1].agent_instance == b.instance
    assert (
        b.state.ranks["live/1/0"].child_pid == live_pid
    )  # the resumed stream re-sends nothing: adopted, not restarted
    assert starts(tmp_path, "live", 0) == 1 and starts(tmp_path, "short", 0) == 1
    assert launcher.pid_alive(live_pid)  # adopted, not restarted, not killed
    fake.kill(3, "live", 1)
    await until(lambda: fake.report("live", 0, S.RANK_STATE_KILLED), what="adopted rank KILLED")
    assert not launcher.pid_alive(live_pid)


async def test_state_dir_is_exclusive(tmp_path):
    a = make_agent(1, tmp_path / "s")
    a._lock.acquire()
    try:
        b = make_agent(1, tmp_path / "s")
        with pytest.raises(StateDirLocked):
            await b.run()
    finally:
        a._lock.release()


async def test_cli_sigterm_kills_ranks_and_exits_zero(fake, tmp_path):
    env = {
        **os.environ,
        "PHALANX_SCHEDULER": f"127.0.0.1:{fake.port}",
        "PHALANX_NODE_NAME": "cli-node",
        "PHALANX_STATE_DIR": str(tmp_path / "cli-state"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.node_agent.main", "--simulate", "pcie-2numa", "--kill-grace", "0.5"]
        + ["--run-as", getpass.getuser()],  # the rank is this interpreter: run it as this user
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        await until(lambda: fake.registrations, timeout=15, what="CLI agent registration")
        assert fake.registrations[0].node_name == "cli-node"
        assert fake.registrations[0].topology.profile == "pcie-2numa"
        fake.launch(1, "cli", 1, [{"rank": 0, "env": rank_env(tmp_path, "cli", 0, SLEEP=60)}])
        await until(lambda: fake.report("cli", 0, S.RANK_STATE_RUNNING), what="RUNNING")
        pid = fake.report("cli", 0, S.RANK_STATE_RUNNING).pid
        proc.send_signal(signal.SIGTERM)
        await until(lambda: proc.poll() is not None, timeout=10, what="agent exit")
        assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
        assert fake.report("cli", 0, S.RANK_STATE_KILLED)
        assert not launcher.pid_alive(pid)
        assert proc.stdout.read() == b""  # logs only on stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
