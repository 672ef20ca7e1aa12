"""Rank logs (issue 21, item 3): `phalanx logs` and Client.logs read a rank's stdout and stderr from its node agent
(AgentLogs), with the address and a credential the scheduler gives (GetRankLogs): every rank prefixed, one rank, the
last lines, following a running rank to its end, an earlier attempt; the agent keeps each log bounded by rotation;
a credential reads only its own job's attempt on its own node. Real scheduler (SQLite and PostgreSQL), real agent,
real rank processes."""

from __future__ import annotations

import asyncio
import getpass
import sys
import time

import grpc
import pytest
from helpers.procs import eventually
from test_node_agent import until

from db.migrate import upgrade
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli.main import main as cli_main
from phalanx.client import Client
from phalanx.common.tokens import log_credential
from phalanx.core.fabric import default_fabric
from services.node_agent import logs as agent_logs
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.simulated import nvml_for_topology, simulated_topology
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

# Prints `n` numbered lines (stderr for odd ones), sleeping `pause` between them; with $GATE, the second half only
# once the file $GATE exists (exit 3 if it does not within 30 s).
PRINTER = (
    "import os, sys, time\n"
    "n, pause = int(sys.argv[1]), float(sys.argv[2])\n"
    "gate = os.environ.get('GATE')\n"
    "for i in range(n):\n"
    "    if gate and i == n // 2:\n"
    "        since = time.time()\n"
    "        while not os.path.exists(gate):\n"
    "            if time.time() - since > 30:\n"
    "                sys.exit(3)\n"
    "            time.sleep(0.02)\n"
    "    print(f'rank {os.environ[\"RANK\"]} line {i}', file=sys.stderr if i % 2 else sys.stdout, flush=True)\n"
    "    time.sleep(pause)\n"
)


@pytest.fixture
async def cluster(db_url, tmp_path, service_logs):
    upgrade(db_url)
    scheduler = await serve(
        SchedulerSettings(
            db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-l"]), heartbeat_interval=0.3
        )
    )
    agent = NodeAgent(
        AgentConfig(
            scheduler=scheduler.address,
            node_name="node-l",
            topology=simulated_topology("node-l", "dgx-h100"),
            state_dir=tmp_path / "agent",
            kill_grace_s=1.0,
            poll_interval_s=0.02,
            health_enabled=False,
            run_as=getpass.getuser(),
            log_max_bytes=4096,
            simulated_nvml=nvml_for_topology,
        )
    )
    task = asyncio.create_task(agent.run())
    await until(lambda: agent.registrations >= 1, timeout=10, what="the agent registered")
    channel = grpc.aio.insecure_channel(scheduler.address)
    try:
        yield scheduler, agent, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await channel.close()
        agent.request_stop()
        await asyncio.wait_for(task, 20)
        await scheduler.stop()


async def _submit(
    stub, name: str, n: int, pause: float, replicas: int = 1, gpus: int = 2, env: dict[str, str] | None = None
) -> common_pb2.Job:
    spec = common_pb2.JobSpec(
        name=name,
        replicas=replicas,
        gpus_per_replica=gpus,
        command=[sys.executable, "-c", PRINTER, str(n), str(pause)],
        env=env or {},
    )
    return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))


async def _finished(stub, job_id: str) -> common_pb2.Job:
    async def done():
        job = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))
        return job if job.state == common_pb2.JOB_STATE_SUCCEEDED else None

    return await eventually(done, timeout=30, what=f"{job_id} succeeded")


def _cli(capsys, address: str, *argv: str) -> tuple[int, list[str], str]:
    code = cli_main(["--scheduler", address, *argv])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


async def test_phalanx_logs_reads_every_rank_one_rank_and_the_tail(cluster, capsys, service_logs):
    scheduler, agent, stub = cluster
    job = await _submit(stub, "printer", 6, 0.0)
    await _finished(stub, job.id)
    code, lines, err = await asyncio.to_thread(_cli, capsys, scheduler.address, "logs", job.id)
    assert code == 0, err
    assert lines == [f"[rank {r}] rank {r} line {i}" for r in range(2) for i in range(6)]  # stdout and stderr
    code, lines, err = await asyncio.to_thread(_cli, capsys, scheduler.address, "logs", job.id, "--rank", "1")
    assert code == 0 and lines == [f"rank 1 line {i}" for i in range(6)]
    code, lines, _ = await asyncio.to_thread(
        _cli, capsys, scheduler.address, "logs", job.id, "--rank", "0", "--tail", "2"
    )
    assert code == 0 and lines == ["rank 0 line 4", "rank 0 line 5"]
    code, lines, err = await asyncio.to_thread(_cli, capsys, scheduler.address, "logs", job.id, "--rank", "7")
    assert code == 1 and "NOT_FOUND" in err and "rank 7" in err
    code, lines, err = await asyncio.to_thread(_cli, capsys, scheduler.address, "logs", job.id, "--attempt", "3")
    assert code == 1 and "has no attempt 3" in err
    code, lines, err = await asyncio.to_thread(_cli, capsys, scheduler.address, "logs", job.id, "--tail", "0")
    assert code == 2 and "--tail must be at least 1" in err


async def test_follow_streams_a_running_rank_to_its_end(cluster, tmp_path):
    """The ranks write their second half only once the follower has received the first (a gate the follower opens):
    so the follower read them as they were written, not once at the end, whatever the machine's speed."""
    scheduler, agent, stub = cluster
    gate = tmp_path / "first-half-received"
    job = await _submit(stub, "slow", 8, 0.05, env={"GATE": str(gate)})

    def follow() -> tuple[list[tuple[int, str]], list[float]]:
        with Client(scheduler.address) as client:
            deadline = time.monotonic() + 20
            while True:  # the job must have been reserved before its ranks have logs
                got, at = [], []
                try:
                    for item in client.logs(job.id, follow=True):
                        got.append(item)
                        at.append(time.monotonic())
                        if len(got) == 8 and not gate.exists():  # lines 0-3 of both ranks: the first halves
                            gate.touch()
                    return got, at
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    got, at = await asyncio.to_thread(follow)
    assert sorted(got) == sorted((r, f"rank {r} line {i}") for r in range(2) for i in range(8))
    for r in range(2):  # each rank's lines in order
        assert [line for rank, line in got if rank == r] == [f"rank {r} line {i}" for i in range(8)]
    # The ranks went on (the gate opened): the first halves came while they ran, streamed as written.
    assert (await _finished(stub, job.id)).state == common_pb2.JOB_STATE_SUCCEEDED


async def test_logs_stay_bounded_and_credentials_read_only_their_own_attempt(cluster):
    scheduler, agent, stub = cluster
    job = await _submit(stub, "chatty", 400, 0.008, replicas=1, gpus=1)  # ~6 KB over 3 s, over the 4 KB bound
    await _finished(stub, job.id)
    path = agent.state_dir / "logs" / f"{job.id}-a1-r0.log"
    await until(lambda: (path.parent / (path.name + ".1")).exists(), timeout=5, what="the log rotated")
    assert path.stat().st_size <= 4096 + 4096
    sources = await stub.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=job.id))
    (source,) = sources.sources
    assert source.node == "node-l" and source.address.endswith(f":{agent.logs_port}")
    async with grpc.aio.insecure_channel(source.address) as channel:
        logs = agent_pb2_grpc.AgentLogsStub(channel)

        async def read(credential: str, job_id: str = job.id, attempt: int = 1) -> tuple[object, bytes]:
            data = b""
            try:
                async for chunk in logs.ReadRankLog(
                    agent_pb2.ReadRankLogRequest(credential=credential, job_id=job_id, attempt=attempt, rank=0)
                ):
                    data += chunk.data
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details().encode()
            return grpc.StatusCode.OK, data

        code, data = await read(source.credential)
        assert code is grpc.StatusCode.OK and data.decode().splitlines()[-1] == "rank 0 line 399"
        assert len(data) > 4096  # the rotated part first, then the rest
        for bad, why in (
            ("", "no log credential"),
            (source.credential[:-4] + "0000", "forged"),
            (log_credential(agent.logs_key, job.id, 1, int(time.time()) - 5), "expired"),
            (log_credential("00" * 32, job.id, 1, int(time.time()) + 60), "forged"),  # another node's key
        ):
            code, details = await read(bad)
            assert code is grpc.StatusCode.PERMISSION_DENIED and why in details.decode(), (bad, details)
        code, details = await read(source.credential, job_id="other", attempt=1)
        assert code is grpc.StatusCode.PERMISSION_DENIED and b"not job other" in details


def test_rotation_and_tail_on_files(tmp_path):
    path = tmp_path / "r.log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(100)))
    assert not agent_logs.rotate(path, 10_000)
    assert agent_logs.rotate(path, 100) and path.stat().st_size == 0
    path.write_bytes(b"line 100\nline 101\n")
    assert agent_logs.tail([agent_logs.rotated(path), path], 3) == b"line 99\nline 100\nline 101\n"
