"""Host CPUs and memory through the node agent: what it registers (a simulated host's profile, the real host, the
--host-cpus / --host-memory overrides), the attempt's cgroup limits from its replicas' reservations (the real cgroup
v1 hierarchies of this host, as root), and a rank the OOM killer ended reported `out of memory (limit ...)`.

Real rank processes against the fake NodeService of test_node_agent (a real grpc.aio server); the limits are read
from the cgroup files themselves."""

from __future__ import annotations

import asyncio
import getpass
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.required import needs
from test_node_agent import FakeNodeService, start_server, until

from phalanx.api.v1 import agent_pb2, common_pb2
from services.node_agent import containment as cgroups
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.host_resources import real_host_resources
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.node_agent.state import AgentState

ROOT = Path(__file__).resolve().parents[2]
S = common_pb2
M = 2**20
G = 2**30
T = 2**40


def _v1_usable() -> str | None:
    if os.geteuid() != 0:
        return "cgroup containment needs root"
    if not all(Path(f"/sys/fs/cgroup/{c}").is_dir() for c in ("memory", "pids", "freezer")):
        return "no cgroup v1 memory, pids and freezer hierarchies on this host"
    return None


V1 = needs("cgroup", _v1_usable())

# Allocates (and touches) 200 MiB, then sleeps: far over a 64M limit.
HOG = [sys.executable, "-c", "import time\nb = b'x' * (200 << 20)\ntime.sleep(30)\n"]


@pytest.fixture
async def fake():
    servicer = FakeNodeService()
    server, port = await start_server(servicer)
    servicer.port = port
    yield servicer
    await server.stop(0)


@pytest.fixture
async def start_agent(tmp_path):
    started: list[tuple[NodeAgent, asyncio.Task]] = []

    def start(port: int, kind: str = "cgroup-v1", **config) -> NodeAgent:
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name="node-r",
                topology=config.pop("topology", None) or simulated_topology("node-r", "dgx-h100"),
                state_dir=config.pop("state_dir", tmp_path / "state"),
                kill_grace_s=0.5,
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                containment_kind=kind,
                run_as=getpass.getuser(),
                health_enabled=False,
                **config,
                simulated_nvml=nvml_for_topology,
            )
        )
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        if task.done():
            continue
        agent.request_stop()
        try:
            await asyncio.wait_for(task, 15)
        except Exception:
            task.cancel()


def launch(
    fake: FakeNodeService,
    job: str,
    ranks: list[int],
    command: list[str],
    *,
    replica: int = 0,
    cpus: float = 0.0,
    memory: int = 0,
    env: dict[int, dict[str, str]] | None = None,
) -> None:
    msg = agent_pb2.LaunchReplica(
        job_id=job, attempt=1, replica=replica, command=command, cpus=cpus, memory_bytes=memory
    )
    for r in ranks:
        msg.ranks.append(
            agent_pb2.RankLaunch(rank=r, local_rank=r, gpus=[r], env={"RANK": str(r), **(env or {}).get(r, {})})
        )
    fake.push(agent_pb2.Assignment(revision=len(fake.assignments) + 1, launch=msg))


def group_file(agent: NodeAgent, job: str, hierarchy: str, name: str) -> str:
    group = agent.containment.open(f"{job}-a1")
    assert group is not None, f"no container for {job}"
    return (group.dirs[hierarchy] / name).read_text().strip()


# --- registration --------------------------------------------------------------------------------------------------


async def test_a_simulated_host_registers_its_profiles_cpus_and_memory(fake, start_agent):
    start_agent(fake.port, "process-group")
    await until(lambda: fake.registrations, what="the registration")
    reg = fake.registrations[0]
    assert reg.cpus == 192 and reg.memory_bytes == 2 * T


async def test_a_gb200_tray_registers_its_two_graces(fake, start_agent):
    start_agent(fake.port, "process-group", topology=simulated_topology("node-r", "gb200-nvl72"))
    await until(lambda: fake.registrations, what="the registration")
    assert (fake.registrations[0].cpus, fake.registrations[0].memory_bytes) == (144, 960 * G)


async def test_overrides_are_registered(fake, start_agent):
    start_agent(fake.port, "process-group", host_cpus=6.5, host_memory=48 * G)
    await until(lambda: fake.registrations, what="the registration")
    assert (fake.registrations[0].cpus, fake.registrations[0].memory_bytes) == (6.5, 48 * G)


async def test_a_topology_of_no_shipped_profile_registers_the_real_host(fake, start_agent):
    topo = simulated_topology("node-r", "dgx-h100")
    topo.profile = "some-dump-file"
    start_agent(fake.port, "process-group", topology=topo)
    await until(lambda: fake.registrations, what="the registration")
    real = real_host_resources()
    assert (fake.registrations[0].cpus, fake.registrations[0].memory_bytes) == (real.cpus, real.memory_bytes)


def _cli_agent(fake: FakeNodeService, tmp: Path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.node_agent.main", "--scheduler", f"127.0.0.1:{fake.port}"]
    argv += ["--node-name", "cli-r", "--state-dir", str(tmp / "cli-state"), "--containment", "process-group"]
    log = open(tmp / "cli-agent.log", "wb")
    try:
        return subprocess.Popen([*argv, *flags], cwd=ROOT, stdout=log, stderr=log)
    finally:
        log.close()


async def test_the_cli_agent_registers_the_host_flags(fake, tmp_path):
    dump = tmp_path / "mybox.txt"
    from phalanx.profiles import load_profile

    dump.write_text(load_profile("pcie-2numa").text.replace("# host_memory: 512G", "# host_memory: 384G"))
    proc = _cli_agent(fake, tmp_path, "--simulate-from", str(dump), "--host-cpus", "12")
    try:
        await until(lambda: fake.registrations, timeout=30, what="the CLI agent registered")
    finally:
        proc.terminate()
        proc.wait(20)
    assert (fake.registrations[0].cpus, fake.registrations[0].memory_bytes) == (12, 384 * G)
    bad = subprocess.run(
        [sys.executable, "-m", "services.node_agent.main", "--scheduler", "127.0.0.1:9", "--simulate", "dgx-h100"]
        + ["--node-name", "n1", "--state-dir", str(tmp_path / "s"), "--host-memory", "lots"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2 and "--host-memory" in bad.stderr


# --- cgroup limits -------------------------------------------------------------------------------------------------


@V1
async def test_the_attempts_cgroup_gets_the_sum_of_its_replicas_here(fake, start_agent):
    agent = start_agent(fake.port)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    launch(fake, "job-l", [0], sleeper, replica=0, cpus=0.5, memory=64 * M)
    await until(lambda: fake.report("job-l", 0, S.RANK_STATE_RUNNING), what="replica 0 RUNNING")
    assert group_file(agent, "job-l", "memory", "memory.limit_in_bytes") == str(64 * M)
    has_cpu = "cpu" in agent.containment.open("job-l-a1").dirs
    assert has_cpu == ("cpu" in cgroups._cgroup_mounts("/proc/self/mounts", "/sys/fs/cgroup")[1])
    if has_cpu:
        assert group_file(agent, "job-l", "cpu", "cpu.cfs_quota_us") == "50000"
        assert group_file(agent, "job-l", "cpu", "cpu.cfs_period_us") == "100000"
    pid = agent.state.ranks["job-l/1/0"].child_pid
    assert pid in agent.containment.open("job-l-a1").pids()

    # A second replica of the attempt lands here (two ranks): the limits grow to the sum, replicas counted once.
    launch(fake, "job-l", [1, 2], sleeper, replica=1, cpus=0.75, memory=96 * M)
    # Both ranks of the replica RUNNING (one report does not say the other's child is started).
    await until(
        lambda: fake.report("job-l", 1, S.RANK_STATE_RUNNING) and fake.report("job-l", 2, S.RANK_STATE_RUNNING),
        what="replica 1 RUNNING",
    )
    assert group_file(agent, "job-l", "memory", "memory.limit_in_bytes") == str(160 * M)
    if has_cpu:
        assert group_file(agent, "job-l", "cpu", "cpu.cfs_quota_us") == "125000"
    assert agent._groups["job-l/1"].memory_limit == 160 * M
    assert {agent.state.ranks[f"job-l/1/{r}"].child_pid for r in range(3)} <= agent.containment.open("job-l-a1").pids()

    # No reservation: no limit (as before).
    launch(fake, "job-n", [3], sleeper)
    await until(lambda: fake.report("job-n", 3, S.RANK_STATE_RUNNING), what="an unlimited attempt RUNNING")
    assert int(group_file(agent, "job-n", "memory", "memory.limit_in_bytes")) > 2**62
    if has_cpu:
        assert group_file(agent, "job-n", "cpu", "cpu.cfs_quota_us") == "-1"


@V1
async def test_the_reservations_survive_an_agent_restart(fake, start_agent, tmp_path):
    agent = start_agent(fake.port)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    launch(fake, "job-s", [0], sleeper, replica=0, cpus=1.0, memory=64 * M)
    await until(lambda: fake.report("job-s", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    await until(lambda: 1 in fake.acks, what="the ack")
    await agent.abort()  # a crash: the rank keeps running
    saved = AgentState.load(tmp_path / "state" / "state.json").ranks["job-s/1/0"]
    assert (saved.cpus, saved.memory_bytes) == (1.0, 64 * M)

    again = start_agent(fake.port)
    await until(lambda: len(fake.registrations) >= 2, what="registered again")
    await until(lambda: "job-s/1" in again._groups, what="the container adopted")
    assert again._groups["job-s/1"].memory_limit == 64 * M
    launch(fake, "job-s", [1], sleeper, replica=1, cpus=0.5, memory=32 * M)
    await until(lambda: fake.report("job-s", 1, S.RANK_STATE_RUNNING), what="the second replica RUNNING")
    assert group_file(again, "job-s", "memory", "memory.limit_in_bytes") == str(96 * M)
    if "cpu" in again.containment.open("job-s-a1").dirs:
        assert group_file(again, "job-s", "cpu", "cpu.cfs_quota_us") == "150000"


# --- out of memory -------------------------------------------------------------------------------------------------


@V1
async def test_a_rank_over_its_memory_is_reported_out_of_memory(fake, start_agent):
    agent = start_agent(fake.port)
    launch(fake, "job-o", [0], HOG, memory=64 * M)
    await until(lambda: fake.report("job-o", 0, S.RANK_STATE_EXITED), timeout=20, what="the hog's end")
    end = fake.report("job-o", 0, S.RANK_STATE_EXITED)
    assert end.message == "out of memory (limit 64M)"
    assert end.exit_code == 137  # SIGKILL, as the agent reports any death by signal (128 + 9)
    await until(lambda: ("job-o", 1) in fake.released, what="the attempt released")
    assert agent.containment.open("job-o-a1") is None and "job-o/1" not in agent.state.oom_seen


@V1
async def test_only_the_rank_the_oom_killer_ended_says_so(fake, start_agent):
    """Two ranks share the attempt's 128M: rank 0 outgrows it and is OOM-killed; rank 1, which later fails on its
    own (exit 3), and rank 2, which exits cleanly, are not told out of memory."""
    start_agent(fake.port)
    script = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    b = b'x' * (400 << 20)\n"
        "    time.sleep(30)\n"
        "time.sleep(float(os.environ['SLEEP']))\n"
        "sys.exit(int(os.environ['CODE']))\n"
    )
    env = {1: {"SLEEP": "3", "CODE": "3"}, 2: {"SLEEP": "3.5", "CODE": "0"}}
    launch(fake, "job-p", [0, 1, 2], [sys.executable, "-c", script], memory=128 * M, env=env)
    await until(lambda: fake.report("job-p", 0, S.RANK_STATE_EXITED), timeout=20, what="rank 0's end")
    assert fake.report("job-p", 0, S.RANK_STATE_EXITED).message == "out of memory (limit 128M)"
    await until(lambda: fake.report("job-p", 2, S.RANK_STATE_EXITED), timeout=20, what="the other ranks' ends")
    one = fake.report("job-p", 1, S.RANK_STATE_EXITED)
    assert (one.exit_code, one.message) == (3, "exited with code 3")
    two = fake.report("job-p", 2, S.RANK_STATE_EXITED)
    assert (two.exit_code, two.message) == (0, "exited with code 0")


@V1
async def test_no_memory_limit_no_oom_message(fake, start_agent):
    """A rank SIGKILLed in an attempt with no memory reservation: no claim of memory, its usual report."""
    agent = start_agent(fake.port)
    launch(fake, "job-k", [0], [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    await until(lambda: fake.report("job-k", 0, S.RANK_STATE_EXITED), what="the rank's end")
    end = fake.report("job-k", 0, S.RANK_STATE_EXITED)
    assert (end.exit_code, end.message) == (137, "exited with code 137")
    assert agent.containment.kind == "cgroup-v1"
