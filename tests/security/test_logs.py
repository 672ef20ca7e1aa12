"""Rank logs against their readers. A real scheduler with a tokens file (SQLite and PostgreSQL), a protocol-level
agent, and the node agent's real AgentLogs servicer over a log folder the test writes (as the agent's launcher
does: launcher.rank_paths).

Threats (who, what they control, what they must not reach):

1. A tenant (bob) asks the scheduler for the log sources of alice's job (GetRankLogs): NOT_FOUND, no address, no
   credential.
2. The same tenant goes to the agent directly (AgentLogs.ReadRankLog) with what he can get: his own job's log
   credential naming her job, one he forged, one signed with another node's key, an expired one: PERMISSION_DENIED,
   no byte of her log.
3. A rank (any tenant's code) writes terminal escape sequences into its output, to act on the terminal of whoever
   reads it (an admin's `phalanx logs`): set its title, write its clipboard (OSC 52), clear or hide lines. On a
   terminal, `phalanx logs` shows them as visible escapes; into a pipe or file it keeps the bytes as written.
4. A rank writes huge lines (megabytes without a newline): the agent streams them in bounded chunks, the whole
   log and its tail, and the reader gets every byte.

The credential checks, one by one, are also in tests/service/test_rank_logs.py (with real rank processes).
"""

from __future__ import annotations

import asyncio
import io
import time

import grpc
import pytest
from helpers.tokens import write_tokens

from db.engine import make_engine
from db.migrate import ensure_rank_key
from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli import console as cli_console
from phalanx.cli import main as cli
from phalanx.client._channel import open_aio_channel
from phalanx.common.tokens import TokenStore, log_credential, node_logs_key
from phalanx.core.fabric import default_fabric
from phalanx.testing.lite_agent import LiteAgent
from services.node_agent import launcher
from services.node_agent.logs import CHUNK, AgentLogsServicer
from services.scheduler.main import serve
from services.scheduler.settings import SchedulerSettings

ENTRIES = [("tok-alice", "alice", "user", ""), ("tok-bob", "bob", "user", ""), ("tok-node-0", "n", "node", "node-0")]
DENIED = grpc.StatusCode.PERMISSION_DENIED


class Logs:
    def __init__(self) -> None:
        self.channels: list[grpc.aio.Channel] = []
        self.alice_job = self.bob_job = self.address = self.node_key = ""
        self.state_dir = None
        self.scheduler = None

    def stub(self, address: str, token: str, kind):
        channel = open_aio_channel(address, token=token)
        self.channels.append(channel)
        return kind(channel)

    async def read(self, credential: str, job: str, tail: int = 0) -> tuple[grpc.StatusCode, bytes, int]:
        """(status, the data, the largest chunk) of rank 0 of `job`, attempt 1."""
        stub = self.stub(self.address, "", agent_pb2_grpc.AgentLogsStub)
        data, largest = b"", 0
        try:
            request = agent_pb2.ReadRankLogRequest(
                credential=credential, job_id=job, attempt=1, rank=0, tail_lines=tail
            )
            async for chunk in stub.ReadRankLog(request):
                data += chunk.data
                largest = max(largest, len(chunk.data))
        except grpc.aio.AioRpcError as exc:
            return exc.code(), (exc.details() or "").encode(), largest
        return grpc.StatusCode.OK, data, largest

    def write_log(self, job: str, data: bytes) -> None:
        path = launcher.rank_paths(self.state_dir, job, 1, 0)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture
async def logs(db_url, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    write_tokens(tokens, ENTRIES)
    scheduler = await serve(
        SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"])),
        tokens=TokenStore(tokens),
    )
    agent = LiteAgent(scheduler.address, "node-0", token="tok-node-0")
    await agent.start()
    engine = make_engine(db_url)
    with engine.begin() as conn:
        key = ensure_rank_key(conn)
    engine.dispose()
    servicer_key = node_logs_key(key, "node-0")
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentLogsServicer_to_server(
        AgentLogsServicer(lambda: servicer_key, tmp_path / "agent", lambda *a: False), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    t = Logs()
    t.address, t.state_dir, t.node_key, t.scheduler = f"127.0.0.1:{port}", tmp_path / "agent", servicer_key, scheduler
    try:
        for who in ("alice", "bob"):
            stub = t.stub(scheduler.address, f"tok-{who}", scheduler_pb2_grpc.SchedulerStub)
            spec = common_pb2.JobSpec(name=who, replicas=1, gpus_per_replica=1, command=["hang"])
            job = (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).id
            for _ in range(200):
                got = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job))
                if got.state == common_pb2.JOB_STATE_RUNNING:
                    break
                await asyncio.sleep(0.05)
            setattr(t, f"{who}_job", job)
            t.write_log(job, f"{who}'s secret output\n".encode())
        yield t
    finally:
        for channel in t.channels:
            await channel.close()
        await server.stop(0)
        await agent.stop()
        await scheduler.stop()


async def test_1_a_tenant_gets_no_log_source_of_another_tenants_job(logs):
    bob = logs.stub(logs.scheduler.address, "tok-bob", scheduler_pb2_grpc.SchedulerStub)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await bob.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=logs.alice_job))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and "phl_" not in (err.value.details() or "")


async def test_2_a_tenants_credential_reads_no_other_job_on_the_agent(logs):
    bob = logs.stub(logs.scheduler.address, "tok-bob", scheduler_pb2_grpc.SchedulerStub)
    (source,) = (await bob.GetRankLogs(scheduler_pb2.GetRankLogsRequest(job_id=logs.bob_job))).sources
    code, data, _ = await logs.read(source.credential, logs.bob_job)
    assert code is grpc.StatusCode.OK and data == b"bob's secret output\n"  # his own: yes
    soon = int(time.time()) + 600
    for credential in (
        source.credential,  # his, for his job
        source.credential.replace(logs.bob_job, logs.alice_job),  # his, rewritten to name hers
        log_credential("00" * 32, logs.alice_job, 1, soon),  # forged with a key of his own
        log_credential(node_logs_key("22" * 32, "node-0"), logs.alice_job, 1, soon),  # another ledger's key
        log_credential(logs.node_key, logs.alice_job, 1, int(time.time()) - 1),  # the right key, expired
        "tok-bob",  # his token as the credential
        "",
    ):
        code, data, _ = await logs.read(credential, logs.alice_job)
        assert code is DENIED and b"secret" not in data, (credential, data)


ESCAPES = (
    b"\x1b]0;pwned\x07",  # set the window title
    b"\x1b]52;c;ZWNobyBoaQ==\x07",  # write the clipboard (OSC 52)
    b"\x1b[2J\x1b[H",  # clear the screen
    b"\x1b[8m",  # conceal what follows
    b"text\rover",  # a carriage return that overwrites the line
    "\x9b31m".encode(),  # an 8-bit CSI (U+009B, as UTF-8)
)


@pytest.mark.parametrize("tty", [True, False], ids=["terminal", "pipe"])
async def test_3_escape_sequences_reach_a_terminal_only_as_visible_text(logs, monkeypatch, tty):
    line = b"before " + b" ".join(ESCAPES) + b" after\n"
    logs.write_log(logs.alice_job, line)

    class Out(io.StringIO):
        def isatty(self) -> bool:
            return tty

    out = Out()
    monkeypatch.setattr(cli_console, "out", lambda: out)
    logs_channel_address = logs.address

    class OneSource:  # the client of `phalanx logs`, pointed at this test's agent
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def logs(self, job_id, **kw):
            async def read():
                return await logs.read(log_credential(logs.node_key, job_id, 1, int(time.time()) + 60), job_id)

            code, data, _ = asyncio.run_coroutine_threadsafe(read(), loop).result(10)
            assert code is grpc.StatusCode.OK, (code, logs_channel_address)
            for text in data.decode("utf-8", errors="replace").split("\n")[:-1]:
                yield 0, text

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(cli_console, "client", lambda args: OneSource())
    args = cli.build_parser().parse_args(["logs", logs.alice_job, "--rank", "0"])
    assert await asyncio.to_thread(cli.cmd_logs, args) == 0
    shown = out.getvalue()
    assert shown.startswith("before ") and shown.endswith(" after\n")
    if tty:
        assert not any(ch in shown for ch in "\x1b\x07\r\x9b"), repr(shown)
        assert "\\x1b]0;pwned\\x07" in shown and "text\\x0dover" in shown and "\\x9b31m" in shown
    else:
        assert shown == line.decode("utf-8", errors="replace")


async def test_4_huge_lines_stream_in_bounded_chunks(logs):
    huge = b"x" * (6 << 20)  # 6 MiB without a newline: over gRPC's default 4 MiB message limit
    logs.write_log(logs.alice_job, huge + b"\nthe last line\n")
    credential = log_credential(logs.node_key, logs.alice_job, 1, int(time.time()) + 60)
    code, data, largest = await logs.read(credential, logs.alice_job)
    assert code is grpc.StatusCode.OK and data == huge + b"\nthe last line\n" and largest <= CHUNK
    code, data, largest = await logs.read(credential, logs.alice_job, tail=1)
    assert code is grpc.StatusCode.OK and data == b"the last line\n"


async def test_4_the_tail_of_a_huge_line_streams_in_bounded_chunks(logs):
    huge = b"x" * (6 << 20)
    logs.write_log(logs.alice_job, huge + b"\nthe last line\n")
    credential = log_credential(logs.node_key, logs.alice_job, 1, int(time.time()) + 60)
    code, data, largest = await logs.read(credential, logs.alice_job, tail=2)
    assert code is grpc.StatusCode.OK, data[:200]
    assert data.endswith(b"x\nthe last line\n") and largest <= CHUNK
