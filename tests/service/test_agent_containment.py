"""The node agent contains its ranks (issue 19): real rank processes, the real cgroup v1 hierarchies of this host
(as root) or the process-group fallback, against the fake NodeService of test_node_agent (a real grpc.aio server).

Each test asserts on the processes themselves (/proc), never on the agent's own bookkeeping alone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.ports import reserved_port
from helpers.waits import eventually
from test_node_agent import FakeNodeService, rank_env, start_server, until

from phalanx.api.v1 import common_pb2
from services.node_agent import containment as cgroups
from services.node_agent import launcher
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology

ROOT = Path(__file__).resolve().parents[2]
S = common_pb2
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and other users need an agent running as root")


def _v1_usable() -> str | None:
    if os.geteuid() != 0:
        return "cgroup containment needs root"
    if not all(Path(f"/sys/fs/cgroup/{c}").is_dir() for c in ("memory", "pids", "freezer")):
        return "no cgroup v1 memory, pids and freezer hierarchies on this host"
    return None


KINDS = [
    pytest.param("cgroup-v1", marks=pytest.mark.skipif(bool(_v1_usable()), reason=_v1_usable() or "")),
    "process-group",
]

# A rank that leaves a daemon: it forks, the child calls setsid and forks again (the grandchild, re-parented to init,
# writes its pid to $DAEMON_PID), then the rank sleeps $SLEEP seconds and exits 0. $IGNORE_TERM=1: both ignore
# SIGTERM. $EXIT_AFTER_TERM=PATH: on SIGTERM both wait for PATH to exist, then exit (processes that take as long to
# stop as the test says).
DAEMON_SCRIPT = (
    "import os, signal, sys, time\n"
    "if os.environ.get('IGNORE_TERM') == '1':\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "def _stop_when_let(*_):\n"
    "    while not os.path.exists(os.environ['EXIT_AFTER_TERM']):\n"
    "        time.sleep(0.02)\n"
    "    os._exit(0)\n"
    "if os.environ.get('EXIT_AFTER_TERM'):\n"
    "    signal.signal(signal.SIGTERM, _stop_when_let)\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.setsid()\n"
    "    if os.fork():\n"
    "        os._exit(0)\n"
    "    path = os.environ['DAEMON_PID']\n"
    "    open(path + '.part', 'w').write(str(os.getpid()))\n"
    "    os.replace(path + '.part', path)\n"
    "    time.sleep(300)\n"
    "    os._exit(0)\n"
    "os.waitpid(pid, 0)\n"
    "time.sleep(float(os.environ.get('SLEEP', '300')))\n"
)


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

    def start(port: int, kind: str, **config) -> NodeAgent:
        agent = NodeAgent(
            AgentConfig(
                scheduler=f"127.0.0.1:{port}",
                node_name="node-c",
                topology=simulated_topology("node-c", "dgx-h100"),
                state_dir=config.pop("state_dir", tmp_path / "state"),
                kill_grace_s=config.pop("kill_grace_s", 0.5),
                backoff_initial_s=0.05,
                backoff_cap_s=0.3,
                poll_interval_s=0.02,
                rpc_timeout_s=2.0,
                flush_timeout_s=2.0,
                containment_kind=kind,
                **config,
                simulated_nvml=nvml_for_topology,
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


def alive(pid: int) -> bool:
    return launcher.pid_alive(pid)


async def daemon_pid(path: Path) -> int:
    await until(path.exists, what=f"the daemon's pid in {path}")
    return int(path.read_text())


def launch_daemon_rank(fake: FakeNodeService, tmp: Path, job: str, **extra) -> Path:
    pid_file = tmp / f"{job}.daemon"
    fake.launch(
        len(fake.assignments) + 1,
        job,
        1,
        [{"rank": 0, "env": rank_env(tmp, job, 0, DAEMON_PID=str(pid_file), **extra)}],
        command=[sys.executable, "-c", DAEMON_SCRIPT],
    )
    return pid_file


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_kills_the_daemon_a_rank_left_and_removes_its_container(fake, start_agent, tmp_path, kind):
    agent = start_agent(fake.port, kind)
    pid_file = launch_daemon_rank(fake, tmp_path, "job-d")
    await until(lambda: fake.report("job-d", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    daemon = await daemon_pid(pid_file)
    assert fake.registrations[0].containment == kind
    group = agent.containment.open("job-d-a1")
    assert group is not None and daemon in group.pids()  # born inside, though it left the rank's session
    if kind == "cgroup-v1" and agent.containment.devices_enforced:
        # The rank's GPU is GPU 0 (rank_env): its device and the control devices, no other GPU's.
        rules = (group.dirs["devices"] / "devices.list").read_text().split("\n")
        assert "c 195:0 rwm" in rules and "c 195:255 rwm" in rules and "c 195:1 rwm" not in rules
    assert os.getsid(daemon) != os.getsid(agent._procs["job-d/1/0"].pid)

    fake.kill(len(fake.assignments) + 1, "job-d", 1)
    await until(lambda: fake.report("job-d", 0, S.RANK_STATE_KILLED), what="KILLED")
    await until(lambda: not alive(daemon), timeout=5, what="the daemon to be killed")
    await until(lambda: agent.containment.open("job-d-a1") is None, timeout=5, what="the container removed")
    await until(lambda: not (tmp_path / "state" / "work" / "job-d-a1").exists(), what="the working dir removed")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_daemon_that_outlives_its_rank_is_killed_when_the_attempt_ends(fake, start_agent, tmp_path, kind):
    agent = start_agent(fake.port, kind)
    pid_file = launch_daemon_rank(fake, tmp_path, "job-e", SLEEP="0.5")
    daemon = await daemon_pid(pid_file)
    await until(lambda: fake.report("job-e", 0, S.RANK_STATE_EXITED), what="EXITED")
    assert fake.report("job-e", 0, S.RANK_STATE_EXITED).exit_code == 0
    await until(lambda: not alive(daemon), timeout=5, what="the lingering daemon to be killed")
    await until(lambda: agent.containment.open("job-e-a1") is None, timeout=5, what="the container removed")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(fake, start_agent, tmp_path, kind):
    agent = start_agent(fake.port, kind, kill_grace_s=0.6)
    pid_file = launch_daemon_rank(fake, tmp_path, "job-t", IGNORE_TERM="1")
    await until(lambda: fake.report("job-t", 0, S.RANK_STATE_RUNNING), what="RUNNING")
    daemon = await daemon_pid(pid_file)
    rank = agent.state.ranks["job-t/1/0"]
    await until(lambda: rank.child_pid != 0, what="the rank's pid")
    child = rank.child_pid
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    fake.kill(len(fake.assignments) + 1, "job-t", 1)
    await until(lambda: not alive(child) and not alive(daemon), timeout=5, what="both SIGKILLed")
    assert loop.time() - t0 >= 0.6  # not before the grace (seen no earlier than it happened)
    killed = await until(lambda: fake.report("job-t", 0, S.RANK_STATE_KILLED), what="KILLED")
    assert killed.exit_code == 128 + 9  # SIGTERM did not end it (it ignores it): the SIGKILL after the grace did
    await until(lambda: agent.containment.open("job-t-a1") is None, timeout=5, what="the container removed")


async def test_a_rank_gets_a_built_environment_and_nothing_else(fake, start_agent, tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_AGENT_TOKEN", "secret-token")
    monkeypatch.setenv("PHALANX_TLS_KEY", "/etc/phalanx/agent.key")
    monkeypatch.setenv("SOMETHING_THE_AGENT_HAD", "1")
    monkeypatch.setenv("PASSED_ON", "yes")
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    agent = start_agent(fake.port, "process-group", pass_env=("PASSED_ON", "NOT_SET_ANYWHERE"))
    from test_node_agent import RANK_CMD

    launch = rank_env(tmp_path, "job-env", 0, SLEEP="30")
    fake.launch(1, "job-env", 1, [{"rank": 0, "env": launch}], command=RANK_CMD)
    out = Path(launch["OUT_FILE"])
    await until(out.exists, what="the rank's environment")
    import json

    env = json.loads(out.read_text())
    inherited = {k for k in os.environ if k in ("PATH", "LANG", "TZ") or k.startswith("LC_")}
    expected = (
        set(launch)
        | inherited
        | {"HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "PASSED_ON", "CUDA_DEVICE_ORDER", cgroups.MARKER_ENV}
        # The rank is Python: in the C locale it adds LC_CTYPE to its own environment (PEP 538 locale coercion).
        | ({"LC_CTYPE"} if "LC_CTYPE" in env and "LC_CTYPE" not in os.environ else set())
    )
    assert set(env) == expected
    assert env["PASSED_ON"] == "yes" and env["LC_TIME"] == "C.UTF-8"
    assert env["USER"] == agent.rank_user.name and env["HOME"] == agent.rank_user.home
    work = tmp_path / "state" / "work" / "job-env-a1"
    assert env["TMPDIR"] == str(work / "tmp") and Path(env["TMPDIR"]).is_dir()


@pytest.fixture
def shared_dir():
    """A directory other users can traverse (pytest's own base directory is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="phalanx-shared-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@ROOT_ONLY
async def test_ranks_run_as_the_run_as_user_who_cannot_read_the_agents_token(fake, start_agent, shared_dir):
    token = shared_dir / "agent.token"
    token.write_text("node-secret\n")
    token.chmod(0o600)
    agent = start_agent(fake.port, "process-group", run_as="nobody", state_dir=shared_dir / "state")
    script = (
        'id -u > uid; id -g > gid; touch "$TMPDIR/t" && echo ok > tmp_ok; '
        f"cat {token} > token 2>&1; echo $? > rc; sleep 30"
    )
    fake.launch(1, "job-u", 1, [{"rank": 0, "env": {"RANK": "0"}}], command=["/bin/sh", "-c", script])
    work = shared_dir / "state" / "work" / "job-u-a1"
    await until(lambda: (work / "rc").exists() and (work / "rc").read_text().strip(), what="the rank's files")
    nobody = agent.rank_user
    assert nobody.name == "nobody"
    assert int((work / "uid").read_text()) == nobody.uid and int((work / "gid").read_text()) == nobody.gid
    assert (work / "tmp_ok").read_text().strip() == "ok"
    assert (work / "rc").read_text().strip() != "0" and "node-secret" not in (work / "token").read_text()
    assert stat.S_IMODE(work.stat().st_mode) == 0o700 and work.stat().st_uid == nobody.uid
    fake.kill(2, "job-u", 1)
    await until(lambda: fake.report("job-u", 0, S.RANK_STATE_KILLED), what="KILLED")


@pytest.mark.parametrize("flag", ["--token-file", "--tls-key"])
def test_the_agent_refuses_a_secret_file_others_can_read(tmp_path, flag):
    secret = tmp_path / "secret"
    secret.write_text("node-secret\n")
    secret.chmod(0o644)
    run = subprocess.run(
        [sys.executable, "-m", "services.node_agent.main", "--scheduler", "127.0.0.1:9", "--simulate", "dgx-h100"]
        + ["--node-name", "n1", "--state-dir", str(tmp_path / "s"), flag, str(secret)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert f"chmod 600 {secret}" in run.stderr and "0644" in run.stderr


def _free_port() -> int:
    return reserved_port()  # the scheduler is restarted on the same address: no port-0 bind may take it meanwhile


@pytest.mark.slow
async def test_an_agent_cut_off_from_the_scheduler_fences_itself_and_registers_again(db_url, tmp_path):
    """Self-fencing after the scheduler is gone: the ranks (and a daemon of theirs) are stopped before the node
    lease runs out, so the gang never runs twice; once the scheduler is back, the agent registers again and the
    requeued gang runs as its next attempt."""
    import grpc

    from db.migrate import upgrade
    from phalanx.api.v1 import scheduler_pb2, scheduler_pb2_grpc
    from phalanx.core.fabric import default_fabric
    from services.scheduler.main import serve
    from services.scheduler.settings import SchedulerSettings

    upgrade(db_url)
    port = _free_port()
    settings = SchedulerSettings(
        db_url=db_url,
        listen=f"127.0.0.1:{port}",
        fabric=default_fabric(["node-f"]),
        heartbeat_interval=0.2,
        lease_timeout=3.0,
        launch_timeout=30.0,
        poll_interval=0.2,
        retry_backoff_s=0.1,
    )
    scheduler = await serve(settings)
    agent = NodeAgent(
        AgentConfig(
            scheduler=f"127.0.0.1:{port}",
            node_name="node-f",
            topology=simulated_topology("node-f", "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=0.5,
            backoff_initial_s=0.05,
            backoff_cap_s=0.3,
            poll_interval_s=0.02,
            rpc_timeout_s=1.0,
            flush_timeout_s=2.0,
            health_enabled=False,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    pid_file = tmp_path / "daemon.pid"
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        await until(lambda: agent.registrations >= 1, timeout=10, what="the agent registered")
        spec = common_pb2.JobSpec(
            name="fenced",
            replicas=1,
            gpus_per_replica=1,
            command=[sys.executable, "-c", DAEMON_SCRIPT],
            env={"DAEMON_PID": str(pid_file)},
            max_restarts=3,
        )
        job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))
        daemon = await daemon_pid(pid_file)
        first = next(r for r in agent.state.ranks.values() if r.job_id == job.id and r.attempt == 1)
        await until(lambda: first.child_pid != 0, what="the rank's pid")
        rank_pid = first.child_pid
        assert agent.fence_after_s() == pytest.approx(1.5)

        # Fenced after the lease less the kill grace and a second: its ranks are gone (SIGKILL after the grace) before
        # the scheduler's lease on the node runs out and it requeues their gang.
        assert agent.fence_after_s() + agent.config.kill_grace_s < settings.lease_timeout
        await scheduler.stop()  # the node is cut off from the scheduler
        await until(lambda: not alive(rank_pid) and not alive(daemon), timeout=8, what="the fenced ranks stopped")
        # Not before that silence: the agent's own measure, from its last answered heartbeat (the test's clock would
        # also count however long the scheduler took to stop).
        assert agent.fenced and agent.fenced_after > agent.fence_after_s()

        pid_file.unlink()
        scheduler = await serve(settings)  # back: the agent registers again and the gang runs once more
        await until(lambda: agent.registrations >= 2 and not agent.fenced, timeout=10, what="registered again")

        async def second_attempt():
            got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.id))
            return got if got.attempt >= 2 and got.state == common_pb2.JOB_STATE_RUNNING else None

        await eventually(second_attempt, timeout=20, what="the requeued gang RUNNING again (attempt 2)")
        await daemon_pid(pid_file)  # the new attempt's own daemon; the old one stayed dead
        assert not alive(daemon)
    finally:
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 20)
        await scheduler.stop()


@pytest.mark.slow
async def test_a_cancelled_gangs_gpus_are_reserved_again_only_once_its_processes_are_gone(db_url, tmp_path):
    """Clean GPU handover: a gang whose rank (and its daemon) take their time to stop after SIGTERM (until the test
    lets them) is cancelled while another gang waits for the same GPUs. The GPUs show as releasing, and the waiting
    gang is reserved only once every process of the first is gone: at no time do both have live processes on those
    GPUs. (Processes that ignore SIGTERM are SIGKILLed after --kill-grace: test_a_rank_that_ignores_sigterm_...)"""
    import grpc

    from db.migrate import upgrade
    from phalanx.api.v1 import scheduler_pb2, scheduler_pb2_grpc
    from phalanx.core.fabric import default_fabric
    from services.scheduler.main import serve
    from services.scheduler.settings import SchedulerSettings

    upgrade(db_url)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url,
            listen="127.0.0.1:0",
            fabric=default_fabric(["node-h"]),
            heartbeat_interval=0.3,
            lease_timeout=30.0,
            poll_interval=0.2,
        )
    )
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name="node-h",
            topology=simulated_topology("node-h", "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=120.0,  # the first gang's processes stop when the test lets them, long before
            poll_interval_s=0.02,
            health_enabled=False,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    channel = grpc.aio.insecure_channel(scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

    async def state_of(job_id: str) -> int:
        return (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).state

    try:
        await until(lambda: agent.registrations >= 1, timeout=10, what="the agent registered")

        def spec(name: str, pid_file: Path, **env: str) -> common_pb2.JobSpec:
            return common_pb2.JobSpec(
                name=name,
                replicas=1,
                gpus_per_replica=8,
                procs_per_replica=1,
                command=[sys.executable, "-c", DAEMON_SCRIPT],
                env={"DAEMON_PID": str(pid_file), **env},
            )

        let_go = tmp_path / "let-the-first-gang-stop"
        first = await stub.SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec("first", tmp_path / "a.pid", EXIT_AFTER_TERM=str(let_go)))
        )
        daemon = await daemon_pid(tmp_path / "a.pid")
        rank = next(r for r in agent.state.ranks.values() if r.job_id == first.id)
        await until(lambda: rank.child_pid != 0, what="the rank's pid")
        olds = [rank.child_pid, daemon]
        second = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec("second", tmp_path / "b.pid")))
        assert await state_of(second.id) == common_pb2.JOB_STATE_PENDING  # its submission's pass found no room

        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=first.id))
        # The first gang's processes got SIGTERM and are still stopping (until the test lets them): its GPUs are
        # releasing, not free, and the second gang waits.
        await until(lambda: rank.kill_requested, what="the agent asked the first gang to stop")
        assert all(alive(p) for p in olds)
        (node,) = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert (node.releasing_gpus, node.free_gpus) == (8, 0)
        assert await state_of(second.id) == common_pb2.JOB_STATE_PENDING  # not on GPUs the first still runs on
        let_go.touch()

        new_daemon = await daemon_pid(tmp_path / "b.pid")  # the second gang runs: by then the first is gone
        assert not any(alive(p) for p in olds)
        assert alive(new_daemon) and await state_of(second.id) == common_pb2.JOB_STATE_RUNNING
        (node,) = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
        assert node.releasing_gpus == 0
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=second.id))
    finally:
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 20)
        await scheduler.stop()


async def test_rank_0_holds_its_master_port_for_the_attempt(fake, start_agent, tmp_path):
    """A launch with rank 0 here takes MASTER_PORT for its attempt: a second live attempt given the same port, or a
    port something else listens on, fails to start (retryable: the scheduler places it again) instead of
    colliding; the port is free again once the first attempt's processes are gone."""
    import socket

    start_agent(fake.port, "process-group")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = reserved_port()  # not taken+1: another test's server may be given that one meanwhile

        def launch(job: str, master_port: int) -> None:
            env = rank_env(tmp_path, job, 0, SLEEP="30", MASTER_PORT=str(master_port))
            fake.launch(len(fake.assignments) + 1, job, 1, [{"rank": 0, "env": env}])

        launch("first", port)
        await until(lambda: fake.report("first", 0, S.RANK_STATE_RUNNING), what="the first attempt RUNNING")
        launch("second", port)
        await until(lambda: fake.report("second", 0, S.RANK_STATE_FAILED_TO_START), what="the second refused")
        refused = fake.report("second", 0, S.RANK_STATE_FAILED_TO_START)
        assert refused.retryable and f"MASTER_PORT {port} is held by attempt first/1" in refused.message
        launch("third", taken)  # a port some other program listens on
        await until(lambda: fake.report("third", 0, S.RANK_STATE_FAILED_TO_START), what="the third refused")
        assert (
            f"MASTER_PORT {taken} is in use on this host"
            in fake.report("third", 0, S.RANK_STATE_FAILED_TO_START).message
        )

    fake.kill(len(fake.assignments) + 1, "first", 1)
    await until(lambda: ("first", 1) in fake.released, what="the first attempt released")
    launch("fourth", port)
    await until(lambda: fake.report("fourth", 0, S.RANK_STATE_RUNNING), what="the port free again")


ID_SCRIPT = 'id -u > uid; id -g > gid; echo "$HOME $USER" > who; sleep 30'


@ROOT_ONLY
async def test_a_launch_runs_as_its_tenants_unix_user(fake, start_agent, shared_dir):
    """The launch names the tenant's Unix user (the scheduler's tokens file): the agent (root, own identity by
    default) runs that attempt's ranks as it; an unknown user fails the start, retryably, saying so."""
    start_agent(fake.port, "process-group", state_dir=shared_dir / "state")
    fake.launch(1, "job-n", 1, [{"rank": 0, "env": {"RANK": "0"}}], ["/bin/sh", "-c", ID_SCRIPT], run_as="nobody")
    work = shared_dir / "state" / "work" / "job-n-a1"
    await until(lambda: (work / "who").exists() and (work / "who").read_text().strip(), what="the rank's files")
    nobody = identity_of("nobody")
    assert int((work / "uid").read_text()) == nobody.uid and (work / "who").read_text().split()[1] == "nobody"
    fake.launch(2, "job-x", 1, [{"rank": 0, "env": {"RANK": "0"}}], ["/bin/true"], run_as="no-such-user-here")
    await until(lambda: fake.report("job-x", 0, S.RANK_STATE_FAILED_TO_START), what="the refused start")
    refused = fake.report("job-x", 0, S.RANK_STATE_FAILED_TO_START)
    assert refused.retryable and "no user 'no-such-user-here' on this host" in refused.message


@ROOT_ONLY
async def test_an_agent_started_as_root_runs_ranks_as_nobody_unless_told(fake, shared_dir):
    argv = [sys.executable, "-m", "services.node_agent.main", "--scheduler", f"127.0.0.1:{fake.port}"]
    argv += ["--node-name", "root-agent", "--simulate", "dgx-h100", "--state-dir", str(shared_dir / "state")]
    log = open(shared_dir / "agent.log", "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=log)
    try:
        await until(lambda: fake.registrations, timeout=20, what="the CLI agent registered")
        fake.launch(1, "job-r", 1, [{"rank": 0, "env": {"RANK": "0"}}], ["/bin/sh", "-c", ID_SCRIPT])
        work = shared_dir / "state" / "work" / "job-r-a1"
        await until(lambda: (work / "uid").exists() and (work / "uid").read_text().strip(), what="the rank's uid")
        assert int((work / "uid").read_text()) == identity_of("nobody").uid
        assert "ranks_run_as_root" not in (shared_dir / "agent.log").read_text()
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def identity_of(name: str):
    from services.node_agent.identity import resolve_user

    return resolve_user(name)
