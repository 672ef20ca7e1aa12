"""The node agent on cgroup v2 under systemd delegation, and the handover of MIG instances (issue 31).

The agent runs real rank processes against the fake NodeService of test_node_agent. Its cgroup v2 containment runs
on the model of tests/helpers/fake_cgroup2.py (this host's v2 mount has no controllers): the rules that forced the
old process-group fallback are applied, ranks join through their real cgroup.procs files, forks are followed by
the containment marker (see the model's docstring), and cgroup.kill SIGKILLs the real processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from helpers.fake_cgroup2 import FakeCgroup2
from test_agent_containment import DAEMON_SCRIPT, _v1_usable, alive, daemon_pid
from test_node_agent import FakeNodeService, rank_env, start_server, until

from phalanx.api.v1 import agent_pb2, common_pb2
from services.node_agent import containment as cgroups
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import simulated_node

S = common_pb2
D = "/system.slice/phalanx-agent.service"
SYSTEMD = ("cpuset", "cpu", "io", "memory", "pids")


def delegated_v2(tmp_path: Path) -> tuple[FakeCgroup2, cgroups.Containment]:
    """A systemd host (Delegate=yes) modelled, and the containment detect() makes there for node-v."""
    fs = FakeCgroup2(tmp_path / "cg" / "unified", SYSTEMD, inherit_by_marker=True)
    fs.nodes["/"].subtree = list(SYSTEMD)
    fs.make("/system.slice", enable=SYSTEMD)
    fs.make(D)
    fs.place(D, os.getpid())
    (tmp_path / "cg" / "mounts").write_text(f"cgroup2 {fs.mount} cgroup2 rw,nsdelegate 0 0\n")
    (tmp_path / "cg" / "cgroup").write_text(f"0::{D}\n")
    c = cgroups.detect(
        node_name="node-v",
        root=str(tmp_path / "cg"),
        mounts=str(tmp_path / "cg" / "mounts"),
        self_cgroup=str(tmp_path / "cg" / "cgroup"),
        fs=fs,
    )
    assert c.kind == "cgroup-v2", c.reason
    return fs, c


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

    def start(port: int, **config) -> NodeAgent:
        state_dir = tmp_path / "state"
        sim = simulated_node("node-v", "dgx-h100", mig_gpus="all", state_dir=state_dir)
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name="node-v",
                topology=sim.topology,
                nvml=sim.nvml,
                state_dir=state_dir,
                kill_grace_s=config.pop("kill_grace_s", 0.5),
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                **config,
            )
        )
        started.append((agent, asyncio.create_task(agent.run())))
        return agent

    yield start
    for agent, task in started:
        agent.request_stop()
        try:
            await asyncio.wait_for(task, 15)
        except Exception:
            task.cancel()


def launch(fake: FakeNodeService, job: str, attempt: int, env: dict, slices=(), gpus=(0,)) -> None:
    msg = agent_pb2.LaunchReplica(job_id=job, attempt=attempt, replica=0, command=[sys.executable, "-c", DAEMON_SCRIPT])
    msg.ranks.append(
        agent_pb2.RankLaunch(
            rank=0,
            local_rank=0,
            gpus=list(gpus),
            env=env,
            slices=[S.MigSlice(gpu=g, profile=p, start=s, size=z) for g, p, s, z in slices],
        )
    )
    fake.push(agent_pb2.Assignment(revision=len(fake.assignments) + 1, launch=msg))


async def test_the_agent_reports_cgroup_v2_and_ends_an_attempt_with_cgroup_kill(fake, start_agent, tmp_path):
    fs, c = delegated_v2(tmp_path)
    agent = start_agent(fake.port, containment=c, kill_grace_s=0.3, pids_max=64)
    pid_file = tmp_path / "v.daemon"
    launch(fake, "job-v", 1, rank_env(tmp_path, "job-v", 0, DAEMON_PID=str(pid_file), IGNORE_TERM="1"))
    await until(lambda: fake.report("job-v", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    assert fake.registrations[0].containment == "cgroup-v2"
    daemon = await daemon_pid(pid_file)
    cg = f"{D}/phalanx-node-v/job-v-a1"
    # The agent left D for D/agent; the attempt's cgroup is beside it (under the agent's parent), with its limit.
    assert fs.cgroup_of(os.getpid()) == f"{D}/agent" and fs.procs(D) == set()
    assert fs.read(fs.path(cg) / "pids.max") == "64"
    wrapper = agent._procs["job-v/1/0"].pid
    await until(lambda: {wrapper, daemon} <= fs.procs(cg), what="the wrapper and the daemon in the attempt's cgroup")

    fake.kill(len(fake.assignments) + 1, "job-v", 1)
    await until(lambda: fake.report("job-v", 0, S.RANK_STATE_KILLED), what="KILLED")
    await until(lambda: ("job-v", 1) in fake.released, what="the release confirmed")
    # Both ignored SIGTERM: the kernel's kill (cgroup.kill) ended them, and only then was the release sent.
    assert fs.writes.count((f"{cg.lstrip('/')}/cgroup.kill", "1")) >= 1
    assert not alive(daemon) and cg not in fs.nodes and not fs.refused


KINDS = [
    "process-group",
    pytest.param("cgroup-v1", marks=pytest.mark.skipif(bool(_v1_usable()), reason=_v1_usable() or "")),
    "cgroup-v2-model",
]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_mig_instance_goes_to_the_next_attempt_only_once_the_old_container_is_empty(
    fake, start_agent, tmp_path, kind
):
    """Attempt 1's rank exits, leaving a daemon that takes its time to stop after SIGTERM (until the test lets it):
    its MIG instance stays its own and no AttemptReleased is sent while the daemon lives; the next attempt (another
    job's), given the same slice, waits. Once the daemon is gone the instance goes, the release is confirmed, and the
    next attempt starts."""
    if kind == "cgroup-v2-model":
        config: dict = {"containment": delegated_v2(tmp_path)[1]}
    else:
        config = {"containment_kind": kind}
    agent = start_agent(fake.port, kill_grace_s=60.0, **config)
    let_go = tmp_path / "let-go"
    slices = [(3, "3g.40gb", 4, 4)]
    env1 = rank_env(tmp_path, "mj", 0, DAEMON_PID=str(tmp_path / "a1.pid"), SLEEP="0.3", EXIT_AFTER_TERM=str(let_go))
    launch(fake, "mj", 1, env1, slices, gpus=(3,))
    daemon = await daemon_pid(tmp_path / "a1.pid")
    rec1 = agent.state.ranks["mj/1/0"]
    await until(lambda: rec1.final, what="attempt 1's rank ended")  # (its report waits for the container)
    instance = {i.start: i.uuid for i in agent.mig.backend.list_instances(3)}[4]
    assert agent.containment.kind == kind.removesuffix("-model")

    launch(fake, "mk", 1, rank_env(tmp_path, "mk", 0, DAEMON_PID=str(tmp_path / "a2.pid"), SLEEP="0.2"), slices, (3,))
    await asyncio.sleep(1.0)  # the daemon got SIGTERM and waits for let_go; the next attempt's rank waits for the slice
    assert alive(daemon)
    assert ("mj", 1) not in fake.released  # no release while a process of the attempt is left
    assert agent.mig.users(3, 4, 4) == {"mj/1/0"} and {i.uuid for i in agent.mig.backend.list_instances(3)} == {
        instance
    }
    assert not (tmp_path / "a2.pid").exists() and not fake.report("mk", 0, S.RANK_STATE_FAILED_TO_START)
    assert not fake.report("mj", 0, S.RANK_STATE_EXITED)  # its end is reported once the container is empty

    let_go.touch()
    await until(lambda: ("mj", 1) in fake.released, what="attempt 1's release")
    assert not alive(daemon)
    assert fake.report("mj", 0, S.RANK_STATE_EXITED)
    await daemon_pid(tmp_path / "a2.pid")  # the next attempt runs, on the slice attempt 1 gave back
    rec = agent.state.ranks.get("mk/1/0")
    assert rec is not None and rec.slices[0]["start"] == 4
    assert agent.mig.users(3, 4, 4) == {"mk/1/0"}
