"""MPS control daemons for fractional GPU shares (services/node_agent/mps.py) and the simulated host's stand-in for
`nvidia-cuda-mps-control` (phalanx/simhost/mps_control.py).

The stand-in records every command it gets in `<state_dir>/mps/gpu<N>/log/commands.jsonl`; the tests check the
daemons' lifecycle through those records and the processes themselves: the manager alone, the NodeAgent against
the fake NodeService of tests/service/test_node_agent.py (real rank processes that write their environment to a file),
a restarted agent, and a real scheduler with a NodeAgent end to end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from phalanx.api.v1 import agent_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.simhost import mps_control
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.mps import MpsError, MpsManager, write_fake_control
from services.node_agent.simulated import fake_gpu_uuid, nvml_for_topology, simulated_topology
from services.node_agent.state import AgentState, RankRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_node_agent import RANK_CMD, RANK_SCRIPT, FakeNodeService, rank_env, start_server, starts, until

S = common_pb2
NODE = "node-a"
H100_MEMORY = 81559


def uuid(gpu: int) -> str:
    return fake_gpu_uuid(NODE, gpu)


def records(mps_root: Path, gpu: int) -> list[dict]:
    path = mps_root / f"gpu{gpu}" / "log" / "commands.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def commands(mps_root: Path, gpu: int, ok: bool = True) -> list[str]:
    """The commands the GPU's daemon took (ok), in order; the refused ones with ok=False."""
    return [r["command"] for r in records(mps_root, gpu) if r["ok"] is ok]


def daemon_pid(mps_root: Path, gpu: int) -> int:
    try:
        return int((mps_root / f"gpu{gpu}" / "pipe" / mps_control.PID_FILE).read_text())
    except (OSError, ValueError):
        return 0


def alive(pid: int) -> bool:
    return launcher.pid_alive(pid)


@pytest.fixture(autouse=True)
def reap_daemons(tmp_path):
    """No stand-in daemon outlives its test (a crashed agent leaves them, as a real one would)."""
    yield
    for pid_file in tmp_path.rglob(mps_control.PID_FILE):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ the stand-in


def test_stand_in_behaves_like_the_control_program(tmp_path):
    control = write_fake_control(tmp_path / "bin")
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
        "CUDA_VISIBLE_DEVICES": "GPU-1234",
    }

    def run(*args, stdin=None):
        return subprocess.run([control, *args], input=stdin, env=env, capture_output=True, text=True, timeout=15)

    r = run(stdin="get_server_list\n")
    assert r.returncode == 1 and "Cannot find MPS control daemon" in r.stderr
    assert run("-d").returncode == 0
    pid = int((tmp_path / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    assert alive(pid) and (tmp_path / "pipe" / "control").exists()
    again = run("-d")
    assert again.returncode == 1 and "already running" in again.stderr
    r = run(
        stdin="get_default_active_thread_percentage\nset_default_active_thread_percentage 30\n"
        "get_default_active_thread_percentage\nset_default_device_pinned_mem_limit 0 2G\n"
        "get_default_device_pinned_mem_limit 0\nget_server_list\n"
    )
    assert r.returncode == 0 and r.stdout.split() == ["100.0", "30.0", "30.0", "2G"]
    assert run(stdin="set_default_device_pinned_mem_limit 0 lots\n").returncode == 1
    assert run(stdin="quit\n").returncode == 0
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid) and not (tmp_path / "pipe" / "control").exists()
    assert run(stdin="quit\n").returncode == 1  # no daemon any more
    got = [
        (r["command"], r["ok"], r["daemon_pid"])
        for r in map(json.loads, (tmp_path / "log" / "commands.jsonl").read_text().splitlines())
    ]
    assert got[:3] == [("get_server_list", False, 0), ("start", True, pid), ("start", False, pid)]
    assert got[-2:] == [("quit", True, pid), ("quit", False, 0)]
    assert "Cmd:set_default_active_thread_percentage 30" in (tmp_path / "log" / "control.log").read_text()


# ------------------------------------------------------------------------------------------------ the manager


def manager(tmp_path: Path, **kw) -> MpsManager:
    root = tmp_path / "mps"
    return MpsManager(root, write_fake_control(root), {g: uuid(g) for g in range(8)}, **kw)


def test_one_daemon_per_gpu_counted_and_quit_after_the_last_share(tmp_path):
    m = manager(tmp_path)
    root = m.root
    a = m.acquire("a/1/0", 3)
    b = m.acquire("b/1/0", 3)
    c = m.acquire("c/1/0", 5)
    assert (
        a
        == b
        == {
            "CUDA_VISIBLE_DEVICES": uuid(3),
            "CUDA_MPS_PIPE_DIRECTORY": str(root / "gpu3" / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "gpu3" / "log"),
        }
    )
    assert c["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu5" / "pipe") and c["CUDA_VISIBLE_DEVICES"] == uuid(5)
    # One start per GPU (then the readiness query), each daemon seeing only its GPU, by UUID; a share joining a
    # running daemon (b) first checks that its user reaches it.
    assert commands(root, 3) == ["start", "get_server_list", "get_server_list"]
    assert commands(root, 5) == ["start", "get_server_list"]
    (s3,) = [r for r in records(root, 3) if r["command"] == "start"]
    (s5,) = [r for r in records(root, 5) if r["command"] == "start"]
    assert (s3["visible_devices"], s5["visible_devices"]) == (uuid(3), uuid(5))
    assert s3["pipe_dir"] == a["CUDA_MPS_PIPE_DIRECTORY"] and s3["daemon_pid"] != s5["daemon_pid"]
    assert m.daemon_pid(3) == s3["daemon_pid"] and alive(s3["daemon_pid"]) and alive(s5["daemon_pid"])
    assert m.users(3) == {"a/1/0", "b/1/0"}
    # The first share ends: its GPU's daemon stays; the last one ends: it quits.
    assert m.release("a/1/0") is False
    assert "quit" not in commands(root, 3) and alive(s3["daemon_pid"])
    assert m.release("b/1/0") is True
    assert commands(root, 3)[-1] == "quit" and not alive(s3["daemon_pid"]) and m.daemon_pid(3) == 0
    assert not (root / "gpu3" / "pipe" / mps_control.PID_FILE).exists()
    assert alive(s5["daemon_pid"]) and "quit" not in commands(root, 5)
    assert m.release("a/1/0") is False  # twice: nothing
    # A new share on GPU 3 starts a new daemon.
    m.acquire("d/1/0", 3)
    assert commands(root, 3).count("start") == 2 and m.daemon_pid(3) not in (0, s3["daemon_pid"])
    assert m.release("d/1/0") and m.release("c/1/0")
    assert commands(root, 5)[-1] == "quit" and not alive(s5["daemon_pid"])


def test_a_daemon_that_cannot_start_raises_and_counts_nothing(tmp_path, monkeypatch):
    m = manager(tmp_path)
    monkeypatch.setenv("PHALANX_FAKE_MPS_FAIL", uuid(2))
    with pytest.raises(MpsError, match=r"-d failed for GPU 2 .*failed to start"):
        m.acquire("a/1/0", 2)
    assert m.users(2) == set() and not m.holds("a/1/0") and m.daemon_pid(2) == 0
    assert commands(m.root, 2, ok=False) == ["start"] and commands(m.root, 2) == []
    m.acquire("b/1/0", 4)  # another GPU is fine
    assert m.daemon_pid(4)
    # the file form of the switch, as `phalanx cluster up` users would use it: here for GPU 6 only
    (m.root / "fake-fail").write_text(uuid(6) + "\n")
    with pytest.raises(MpsError):
        m.acquire("c/1/0", 6)
    m.acquire("d/1/0", 7)
    monkeypatch.delenv("PHALANX_FAKE_MPS_FAIL")
    (m.root / "fake-fail").unlink()
    m.acquire("e/1/0", 2)
    assert m.daemon_pid(2) and commands(m.root, 2) == ["start", "get_server_list"]
    for key in ("b/1/0", "d/1/0", "e/1/0"):
        assert m.release(key)


def test_a_dead_daemon_is_replaced_not_trusted(tmp_path):
    m = manager(tmp_path)
    m.acquire("a/1/0", 1)
    pid = m.daemon_pid(1)
    os.kill(pid, signal.SIGKILL)  # crashed: its pid file and socket stay behind
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert m.daemon_pid(1) == 0 and daemon_pid(m.root, 1) == pid
    m.acquire("b/1/0", 1)  # the next share on the GPU gets a new daemon
    assert m.daemon_pid(1) not in (0, pid) and commands(m.root, 1).count("start") == 2
    assert m.release("a/1/0") is False and m.release("b/1/0") is True
    assert commands(m.root, 1)[-1] == "quit"


def test_missing_control_program_is_an_mps_error(tmp_path):
    m = MpsManager(tmp_path / "mps", str(tmp_path / "no-such-mps-control"), {0: uuid(0)})
    with pytest.raises(MpsError, match="was not found"):
        m.acquire("a/1/0", 0)
    with pytest.raises(MpsError, match="no UUID"):
        m.acquire("a/1/0", 9)


# ------------------------------------------------------------------------------------------------ the agent


@pytest.fixture
async def fake():
    servicer = FakeNodeService()
    server, port = await start_server(servicer)
    servicer.server, servicer.port = server, port
    yield servicer
    await servicer.server.stop(0)


@pytest.fixture
async def agents(tmp_path):
    started: list[tuple[NodeAgent, asyncio.Task]] = []

    def start(port, state_dir=None) -> NodeAgent:
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name=NODE,
                topology=simulated_topology(NODE, "dgx-h100"),
                state_dir=state_dir or tmp_path / "state",
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                simulated_nvml=nvml_for_topology,
            )
        )
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        if not task.done():
            agent.request_stop()
            try:
                await asyncio.wait_for(task, 10)
            except Exception:
                task.cancel()


def launch(
    fake: FakeNodeService,
    revision: int,
    job: str,
    ranks: list[dict],
    attempt: int = 1,
    env: dict | None = None,
    command: list[str] | None = None,
) -> None:
    """ranks: {rank, gpus, env, gpu_milli, slices: [(gpu, profile, start, size)]}."""
    msg = agent_pb2.LaunchReplica(job_id=job, attempt=attempt, replica=0, command=command or RANK_CMD, env=env or {})
    for r in ranks:
        msg.ranks.append(
            agent_pb2.RankLaunch(
                rank=r["rank"],
                local_rank=r["rank"],
                gpus=r["gpus"],
                env=r["env"],
                gpu_milli=r.get("gpu_milli", 0),
                slices=[S.MigSlice(gpu=g, profile=p, start=s, size=z) for g, p, s, z in r.get("slices", [])],
            )
        )
    fake.push(agent_pb2.Assignment(revision=revision, launch=msg))


def env_of(tmp: Path, job: str, rank: int) -> dict:
    return json.loads((tmp / f"{job}-r{rank}.env.json").read_text())


def mps_vars(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}


@pytest.mark.slow
async def test_agent_one_daemon_per_gpu_before_the_ranks_and_quit_after_the_last(fake, agents, tmp_path, monkeypatch):
    # Whatever the agent's own environment says about MPS, no rank inherits it.
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "somebody-elses-mps"))
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "77")
    agent = agents(fake.port)
    root = tmp_path / "state" / "mps"
    launch(
        fake,
        1,
        "s",
        [
            {
                "rank": 0,
                "gpus": [3],
                "env": rank_env(tmp_path, "s", 0, 2, CUDA_VISIBLE_DEVICES="3", SLEEP=0.2),
                "gpu_milli": 250,
            },
            {
                "rank": 1,
                "gpus": [3],
                "env": rank_env(tmp_path, "s", 1, 2, CUDA_VISIBLE_DEVICES="3", SLEEP=2.5),
                "gpu_milli": 500,
            },
        ],
    )
    launch(
        fake,
        2,
        "t",
        [{"rank": 0, "gpus": [5], "env": rank_env(tmp_path, "t", 0, CUDA_VISIBLE_DEVICES="5"), "gpu_milli": 100}],
    )
    # A whole-GPU rank whose launch even carries MPS variables.
    launch(
        fake,
        3,
        "w",
        [
            {
                "rank": 0,
                "gpus": [4],
                "env": rank_env(tmp_path, "w", 0, CUDA_VISIBLE_DEVICES="4", CUDA_MPS_CLIENT_PRIORITY="1"),
            }
        ],
        env={"CUDA_MPS_PIPE_DIRECTORY": str(root / "gpu3" / "pipe")},
    )
    await until(
        lambda: (
            fake.report("s", 0, S.RANK_STATE_EXITED)
            and fake.report("t", 0, S.RANK_STATE_EXITED)
            and fake.report("w", 0, S.RANK_STATE_EXITED)
        ),
        what="the short ranks EXITED",
    )
    await until(lambda: not agent._releases, what="the ended shares released")  # their MPS releases ran
    # GPU 3: one daemon for both shares, started before them; still there while its second share runs.
    (start3,) = [r for r in records(root, 3) if r["command"] == "start"]
    assert start3["ok"] and start3["visible_devices"] == uuid(3)
    assert start3["time"] < (tmp_path / "s-r0.env.json").stat().st_mtime
    assert "quit" not in commands(root, 3) and alive(start3["daemon_pid"])
    # Rank 0's share is held until its attempt's container is empty (rank 1 still runs in it): a process rank 0
    # left could still be a client of the daemon.
    assert agent.mps.users(3) == {"s/1/0", "s/1/1"}
    e0, e1 = env_of(tmp_path, "s", 0), env_of(tmp_path, "s", 1)
    assert mps_vars(e0) == {
        "CUDA_MPS_PIPE_DIRECTORY": str(root / "gpu3" / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(root / "gpu3" / "log"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20389M",
    }
    assert e0["CUDA_VISIBLE_DEVICES"] == uuid(3) == e1["CUDA_VISIBLE_DEVICES"] and e0["PHALANX_GPU_MILLI"] == "250"
    assert (e1["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], e1["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("50", "0=40779M")
    assert e1["CUDA_MPS_PIPE_DIRECTORY"] == e0["CUDA_MPS_PIPE_DIRECTORY"]
    # GPU 5: a daemon of its own, with its own pipe directory; it quit when its one share ended.
    et = env_of(tmp_path, "t", 0)
    assert et["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu5" / "pipe") and et["CUDA_VISIBLE_DEVICES"] == uuid(5)
    await until(lambda: commands(root, 5) == ["start", "get_server_list", "quit"], what="GPU 5's daemon quit")
    (start5,) = [r for r in records(root, 5) if r["command"] == "start"]
    assert start5["visible_devices"] == uuid(5) and start5["daemon_pid"] != start3["daemon_pid"]
    # A whole GPU: no MPS variable at all, and no daemon.
    assert mps_vars(env_of(tmp_path, "w", 0)) == {} and env_of(tmp_path, "w", 0)["CUDA_VISIBLE_DEVICES"] == uuid(4)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["gpu3", "gpu5"]
    # The last share on GPU 3 ends: its daemon quits.
    await until(lambda: fake.report("s", 1, S.RANK_STATE_EXITED), what="the long share EXITED")
    await until(
        lambda: commands(root, 3) == ["start", "get_server_list", "get_server_list", "quit"], what="GPU 3's daemon quit"
    )
    await until(lambda: not alive(start3["daemon_pid"]), what="GPU 3's daemon gone")
    assert all(not r.retryable for r in fake.reports)


async def test_mig_rank_env_has_no_mps_variables(tmp_path):
    agent = NodeAgent(
        AgentConfig(
            scheduler="x:1",
            node_name=NODE,
            topology=simulated_topology(NODE, "dgx-h100"),
            state_dir=tmp_path / "state",
            simulated_nvml=nvml_for_topology,
        )
    )
    agent.mig.acquire = lambda key, wanted, *rest, **kw: [{**wanted[0], "uuid": "MIG-0123", "created": True}]
    rec = RankRecord(
        job_id="m", attempt=1, rank=0, gpus=[6], slices=[{"gpu": 6, "profile": "3g.40gb", "start": 4, "size": 4}]
    )
    env = await agent._rank_env(
        rec,
        {
            "RANK": "0",
            "CUDA_VISIBLE_DEVICES": "6",
            "CUDA_MPS_PIPE_DIRECTORY": "/x",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10",
        },
    )
    assert env == {"RANK": "0", "CUDA_VISIBLE_DEVICES": "MIG-0123"}
    assert not (tmp_path / "state" / "mps" / "gpu6").exists()


async def test_agent_daemon_that_fails_gives_a_retryable_failed_to_start(fake, agents, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_FAKE_MPS_FAIL", uuid(2))
    agents(fake.port)
    root = tmp_path / "state" / "mps"
    launch(fake, 1, "bad", [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "bad", 0), "gpu_milli": 300}])
    launch(fake, 2, "good", [{"rank": 0, "gpus": [1], "env": rank_env(tmp_path, "good", 0), "gpu_milli": 300}])
    launch(
        fake,
        3,
        "both",
        [
            {
                "rank": 0,
                "gpus": [0],
                "env": rank_env(tmp_path, "both", 0),
                "gpu_milli": 300,
                "slices": [(0, "1g.10gb", 0, 1)],
            }
        ],
    )
    await until(
        lambda: (
            fake.report("bad", 0, S.RANK_STATE_FAILED_TO_START)
            and fake.report("good", 0, S.RANK_STATE_EXITED)
            and fake.report("both", 0, S.RANK_STATE_FAILED_TO_START)
        ),
        what="reports",
    )
    bad = fake.report("bad", 0, S.RANK_STATE_FAILED_TO_START)
    assert bad.retryable and "MPS" in bad.message and "failed to start" in bad.message
    assert fake.states("bad", 0) == [S.RANK_STATE_FAILED_TO_START] and starts(tmp_path, "bad", 0) == 0
    assert not fake.report("both", 0, S.RANK_STATE_FAILED_TO_START).retryable  # the job's fault, not the host's
    assert commands(root, 2, ok=False) == ["start"] and commands(root, 2) == []
    assert not fake.report("good", 0, S.RANK_STATE_EXITED).retryable
    # the host is fixed: the next share on GPU 2 starts
    monkeypatch.delenv("PHALANX_FAKE_MPS_FAIL")
    launch(fake, 4, "bad", [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "bad", 0), "gpu_milli": 300}], attempt=2)
    await until(
        lambda: any(r.job_id == "bad" and r.attempt == 2 and r.state == S.RANK_STATE_EXITED for r in fake.reports),
        what="attempt 2 EXITED",
    )
    await until(lambda: commands(root, 2) == ["start", "get_server_list", "quit"], what="GPU 2's daemon came and went")


@pytest.mark.slow
async def test_restarted_agent_adopts_running_daemons_and_stops_unused_ones(fake, agents, tmp_path):
    state_dir = tmp_path / "state"
    root = state_dir / "mps"
    a = agents(fake.port, state_dir)
    launch(
        fake, 1, "live", [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "live", 0, SLEEP=60), "gpu_milli": 400}]
    )
    launch(
        fake, 2, "short", [{"rank": 0, "gpus": [6], "env": rank_env(tmp_path, "short", 0, SLEEP=0.6), "gpu_milli": 400}]
    )
    await until(
        lambda: fake.report("live", 0, S.RANK_STATE_RUNNING) and fake.report("short", 0, S.RANK_STATE_RUNNING),
        what="RUNNING",
    )
    await until(lambda: 2 in fake.acks, what="acks")
    pid2, pid6 = daemon_pid(root, 2), daemon_pid(root, 6)
    assert alive(pid2) and alive(pid6)
    await a.abort()  # a crash: ranks and daemons keep running
    await until(
        lambda: (
            (tmp_path / "short-r0.env.json").exists()
            and launcher.read_status(AgentState.load(state_dir / "state.json").ranks["short/1/0"].status_file).get(
                "state"
            )
            == "exited"
        ),
        what="the short share ended while no agent ran",
    )
    assert alive(pid6)  # nobody stopped it yet
    b = agents(fake.port, state_dir)
    await until(lambda: fake.report("short", 0, S.RANK_STATE_EXITED), what="short EXITED")
    # GPU 6's daemon has no live share any more: the new agent stops it. GPU 2's: adopted, same process.
    await until(lambda: not alive(pid6), what="GPU 6's daemon stopped")
    assert commands(root, 6) == ["start", "get_server_list", "quit"]
    assert commands(root, 2) == ["start", "get_server_list"] and commands(root, 2, ok=False) == []
    assert alive(pid2) and b.mps.daemon_pid(2) == pid2 and b.mps.users(2) == {"live/1/0"}
    # Another share on GPU 2 uses the adopted daemon; it ends, and the daemon stays for the adopted rank.
    launch(fake, 3, "more", [{"rank": 0, "gpus": [2], "env": rank_env(tmp_path, "more", 0), "gpu_milli": 100}])
    await until(lambda: fake.report("more", 0, S.RANK_STATE_EXITED), what="more EXITED")
    await until(lambda: not b._releases, what="more's share released")
    assert env_of(tmp_path, "more", 0)["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu2" / "pipe")
    # (the second get_server_list: the new share's user checked that it reaches the adopted daemon)
    assert commands(root, 2) == ["start", "get_server_list", "get_server_list"] and alive(pid2)
    # The adopted rank ends: its daemon quits.
    fake.kill(4, "live", 1)
    await until(lambda: fake.report("live", 0, S.RANK_STATE_KILLED), what="live KILLED")
    await until(
        lambda: commands(root, 2) == ["start", "get_server_list", "get_server_list", "quit"], what="GPU 2's daemon quit"
    )
    await until(lambda: not alive(pid2), what="GPU 2's daemon gone")


async def test_agent_shutdown_stops_the_daemons(fake, agents, tmp_path):
    agent = agents(fake.port)
    root = tmp_path / "state" / "mps"
    launch(
        fake, 1, "long", [{"rank": 0, "gpus": [7], "env": rank_env(tmp_path, "long", 0, SLEEP=60), "gpu_milli": 200}]
    )
    await until(lambda: fake.report("long", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    pid = daemon_pid(root, 7)
    assert alive(pid)
    await agent.stop()
    assert fake.report("long", 0, S.RANK_STATE_KILLED)
    assert commands(root, 7)[-1] == "quit" and not alive(pid)


def test_cli_flag_and_environment(monkeypatch, tmp_path):
    from services.node_agent.main import parse_args

    assert parse_args(["--mps-control", "/opt/nvidia/mps-control"]).mps_control == "/opt/nvidia/mps-control"
    monkeypatch.setenv("PHALANX_MPS_CONTROL", "/usr/local/bin/nvidia-cuda-mps-control")
    assert parse_args([]).mps_control == "/usr/local/bin/nvidia-cuda-mps-control"
    monkeypatch.delenv("PHALANX_MPS_CONTROL")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("mps-control: /srv/mps-control\n")
    assert parse_args(["--config", str(cfg)]).mps_control == "/srv/mps-control"
    assert parse_args([]).mps_control is None
    # The default: the stand-in, by path, for a simulated host; the real program for a discovered one.
    sim = NodeAgent(
        AgentConfig(
            scheduler="x:1",
            node_name=NODE,
            topology=simulated_topology(NODE, "dgx-h100"),
            state_dir=tmp_path / "sim",
            simulated_nvml=nvml_for_topology,
        )
    )
    assert sim.mps.control == str(tmp_path / "sim" / "mps" / "nvidia-cuda-mps-control")
    assert os.access(sim.mps.control, os.X_OK)
    nvml = simulated_topology(NODE, "dgx-h100")
    nvml.profile = "nvml"
    real = NodeAgent(
        AgentConfig(
            scheduler="x:1",
            node_name=NODE,
            topology=nvml,
            state_dir=tmp_path / "real",
            health_enabled=False,
            mig_backend=object(),
        )
    )
    assert real.mps.control == "nvidia-cuda-mps-control"
    given = NodeAgent(
        AgentConfig(
            scheduler="x:1",
            node_name=NODE,
            topology=simulated_topology(NODE, "dgx-h100"),
            state_dir=tmp_path / "given",
            mps_control="/opt/mps",
            simulated_nvml=nvml_for_topology,
        )
    )
    assert given.mps.control == "/opt/mps"


# ------------------------------------------------------------------------------------------------ end to end


async def test_end_to_end_scheduler_and_agent_share_one_daemon(db_url, tmp_path):
    from phalanx.core.fabric import default_fabric
    from services.scheduler.main import serve
    from services.scheduler.settings import SchedulerSettings

    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric([NODE]),
            heartbeat_interval=0.2,
            lease_timeout=5.0,
            poll_interval=0.2,
        )
    )
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name=NODE,
            topology=simulated_topology(NODE, "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=0.5,
            backoff_initial_s=0.05,
            backoff_cap_s=0.3,
            poll_interval_s=0.02,
            rpc_timeout_s=2.0,
            flush_timeout_s=2.0,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    channel = grpc.aio.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    root = tmp_path / "agent" / "mps"
    try:

        async def submit(name: str) -> common_pb2.Job:
            spec = common_pb2.JobSpec(
                name=name,
                replicas=1,
                gpus_per_replica=1,
                gpu_milli=400,
                command=RANK_CMD,
                env={"OUT_FILE": str(tmp_path / f"{name}.env.json"), "SLEEP": "60"},
            )
            return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))

        async def job_state(job_id: str) -> int:
            return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).state

        async def wait(pred, what: str, timeout: float = 15.0) -> None:
            deadline = time.monotonic() + timeout
            while not await pred():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        async def registered() -> bool:
            return bool((await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes)

        await wait(registered, "the node registered")
        one, two = await submit("one"), await submit("two")
        for j in (one, two):
            await wait(lambda j=j: _is(job_state(j.id), common_pb2.JOB_STATE_RUNNING), f"job {j.id} RUNNING")
        jobs = [await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=j.id)) for j in (one, two)]
        gpus = {j.allocations[0].gpus[0] for j in jobs}
        assert len(gpus) == 1 and all(j.allocations[0].gpu_milli == 400 for j in jobs)  # packed onto one GPU
        (gpu,) = gpus
        await until(
            lambda: (tmp_path / "one.env.json").exists() and (tmp_path / "two.env.json").exists(),
            what="the ranks' environments",
        )
        for name in ("one", "two"):
            env = json.loads((tmp_path / f"{name}.env.json").read_text())
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / f"gpu{gpu}" / "pipe")
            assert env["CUDA_VISIBLE_DEVICES"] == uuid(gpu) and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={H100_MEMORY * 400 // 1000}M"
        # (the second share's user checks that it reaches the running daemon: a second get_server_list)
        assert commands(root, gpu) == ["start", "get_server_list", "get_server_list"]
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [f"gpu{gpu}"]
        pid = daemon_pid(root, gpu)
        # The first job ends: the daemon stays for the second; the second ends: it quits.
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=one.id))
        await until(
            lambda: all(r.final for r in agent.state.ranks.values() if r.job_id == one.id),
            what="job one's rank ended",  # (and, once reported, dropped from the state)
        )
        await until(lambda: len(agent.mps.users(gpu)) == 1 and not agent._releases, what="one share left")
        assert [k.split("/")[0] for k in agent.mps.users(gpu)] == [two.id]
        assert "quit" not in commands(root, gpu) and alive(pid)
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=two.id))
        await until(
            lambda: commands(root, gpu) == ["start", "get_server_list", "get_server_list", "quit"],
            what="the daemon quit",
        )
        await until(lambda: not alive(pid), what="the daemon gone")
    finally:
        await agent.stop()
        if not task.done():
            task.cancel()
        await channel.close()
        await scheduler.stop()


async def _is(state, wanted: int) -> bool:
    return (await state) == wanted


# ------------------------------------------------------------------------------------------------ the ranks' identity


def _uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


@pytest.fixture
def shared_dir():
    """A directory other users can traverse (pytest's own base directory is private to root); its daemons are
    stopped after the test."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="phalanx-mps-"))
    path.chmod(0o711)
    yield path
    for pid_file in path.rglob(mps_control.PID_FILE):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def _others_cannot_run_python() -> str | None:
    """The stand-in daemon and the share ranks run as nobody: they need a Python others can reach."""
    from services.node_agent.mps import _reachable_by_others, python_for_others

    if not _reachable_by_others(Path(python_for_others()).resolve()):
        return f"no Python on this host is executable by other users ({sys.executable} is not), so nobody cannot run"
    return None


ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0 or bool(_others_cannot_run_python()),
    reason="running ranks as another user needs root" if os.geteuid() != 0 else (_others_cannot_run_python() or ""),
)


@ROOT_ONLY
def test_the_daemon_runs_as_the_ranks_user_and_serves_only_it(shared_dir):
    from services.node_agent.identity import resolve_user

    nobody = resolve_user("nobody")
    m = manager(shared_dir)
    env = m.acquire("a/1/0", 2, user=nobody)
    pid = m.daemon_pid(2)
    assert pid and _uid_of(pid) == nobody.uid  # the control daemon itself runs as the ranks' user
    for d in (m.pipe_dir(2), m.log_dir(2)):
        st = d.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (nobody.uid, nobody.gid, 0o700), d
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(m.pipe_dir(2)) and env["CUDA_MPS_LOG_DIRECTORY"] == str(m.log_dir(2))
    info = json.loads((m.gpu_dir(2) / "daemon.json").read_text())
    assert (info["uid"], info["user"]) == (nobody.uid, "nobody")
    assert [r["command"] for r in records(m.root, 2)] == ["start", "get_server_list"]

    # Another user's share (here the agent's own, root) is refused while nobody's daemon runs: MPS would queue it.
    with pytest.raises(MpsError, match=f"runs as uid {nobody.uid}"):
        m.acquire("r/1/0", 2)
    assert m.users(2) == {"a/1/0"}
    # A second share of nobody's reaches the daemon as nobody, and is counted.
    m.acquire("b/1/0", 2, user=nobody)
    assert m.users(2) == {"a/1/0", "b/1/0"}
    # A rank whose user cannot reach the daemon's pipes (here: they were taken from it) does not start.
    os.chown(m.pipe_dir(2), 0, 0)
    with pytest.raises(MpsError, match="the rank's user \\(nobody\\) cannot reach GPU 2's MPS daemon"):
        m.acquire("c/1/0", 2, user=nobody)
    assert m.users(2) == {"a/1/0", "b/1/0"}
    os.chown(m.pipe_dir(2), nobody.uid, nobody.gid)
    assert not m.release("a/1/0") and m.release("b/1/0")  # the last share: quit (sent as nobody)
    assert not alive(pid) and commands(m.root, 2)[-1] == "quit"
    # The next share, of another user (root), gets a daemon of its own user, in directories handed over to it.
    m.acquire("r/1/0", 2)
    assert _uid_of(m.daemon_pid(2)) == 0 and m.pipe_dir(2).stat().st_uid == 0
    m.release("r/1/0")


@ROOT_ONLY
async def test_agent_share_ranks_run_as_nobody_with_their_daemon_and_fail_when_they_cannot_reach_it(fake, shared_dir):
    from services.node_agent.identity import resolve_user
    from services.node_agent.mps import python_for_others

    nobody = resolve_user("nobody")
    out = shared_dir / "out"
    out.mkdir()
    out.chmod(0o777)
    agent = NodeAgent(
        AgentConfig(
            scheduler=f"127.0.0.1:{fake.port}",
            node_name=NODE,
            topology=simulated_topology(NODE, "dgx-h100"),
            state_dir=shared_dir / "state",
            run_as="nobody",
            kill_grace_s=0.5,
            backoff_initial_s=0.05,
            backoff_cap_s=0.3,
            poll_interval_s=0.02,
            rpc_timeout_s=2.0,
            flush_timeout_s=2.0,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    try:
        root = shared_dir / "state" / "mps"
        # The rank runs as nobody, so with a Python nobody can run (this one may sit in root's private home).
        as_nobody = [python_for_others(), "-I", "-c", RANK_SCRIPT]
        one = [{"rank": 0, "gpus": [1], "env": rank_env(out, "n", 0, SLEEP=30), "gpu_milli": 300}]
        launch(fake, 1, "n", one, command=as_nobody)
        await until(lambda: (out / "n-r0.env.json").exists(), what="the share rank's environment")
        env = env_of(out, "n", 0)
        pid = daemon_pid(root, 1)
        assert env["USER"] == "nobody" and _uid_of(pid) == nobody.uid
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu1" / "pipe")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(root / "gpu1" / "log")
        assert (root / "gpu1" / "pipe").stat().st_uid == nobody.uid

        # The pipes are no longer reachable by nobody: the next share rank fails to start, saying why (it never
        # runs without MPS).
        os.chown(root / "gpu1" / "pipe", 0, 0)
        two = [{"rank": 0, "gpus": [1], "env": rank_env(out, "m", 0), "gpu_milli": 200}]
        launch(fake, 2, "m", two, command=as_nobody)
        await until(lambda: fake.report("m", 0, S.RANK_STATE_FAILED_TO_START), what="FAILED_TO_START")
        failed = fake.report("m", 0, S.RANK_STATE_FAILED_TO_START)
        assert "cannot reach GPU 1's MPS daemon" in failed.message and failed.retryable
        assert not (out / "m-r0.env.json").exists()
        os.chown(root / "gpu1" / "pipe", nobody.uid, nobody.gid)
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 15)
