"""The node agent's scheduler session (services/node_agent/session.py) against an in-process NodeService: the
reporter outlives a session whose channel closes under a report in flight (grpc.aio cancels that call, which
surfaces as asyncio.CancelledError in the reporter: it used to end the reporter, and the agent then sent no report
until it stopped: the flake of test_an_agent_cut_off_from_the_scheduler_fences_itself_and_registers_again)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import structlog

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from services.node_agent._background import Background
from services.node_agent.reports import ReportQueue
from services.node_agent.session import SchedulerSession
from services.node_agent.state import AgentState, RankRecord


class _Service(agent_pb2_grpc.NodeServiceServicer):
    """Holds the first report until told (a scheduler gone quiet); answers every later one."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.reports: list[tuple[str, int]] = []

    async def ReportRankStatus(self, request, context):
        if not self.held.is_set():
            self.held.set()
            await self.release.wait()
        self.reports.append((request.job_id, request.state))
        return agent_pb2.ReportRankStatusResponse()


async def _until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_the_reporter_survives_a_channel_closed_under_its_call(tmp_path):
    service = _Service()
    server = grpc.aio.server()
    agent_pb2_grpc.add_NodeServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = SimpleNamespace(
        node_name="node-s",
        scheduler=f"127.0.0.1:{port}",
        default_heartbeat_ms=1000,
        rpc_timeout_s=30.0,  # longer than the test: only the channel's close ends the held call
        backoff_initial_s=0.01,
        backoff_cap_s=0.05,
    )
    state = AgentState.load(tmp_path / "state.json", node_name="node-s")
    reports = ReportQueue(state)
    session = SchedulerSession(
        config,
        state,
        structlog.get_logger(),
        "instance-1",
        reports,
        ranks=SimpleNamespace(),
        devices=SimpleNamespace(),
        background=Background(),
        stop=asyncio.Event(),
        registration=dict,
    )
    first = grpc.aio.insecure_channel(config.scheduler)
    try:
        session.stub = agent_pb2_grpc.NodeServiceStub(first)
        session.connected.set()
        reports.rank(RankRecord(job_id="job-1", attempt=1, rank=0), "killed", message="fenced")
        session.start_reporter()
        await asyncio.wait_for(service.held.wait(), 5)  # the report is in flight, unanswered

        # The session ends as _session's finally does: no stub, then its channel closed (the call is cancelled).
        session.connected.clear()
        session.stub = None
        await first.close(grace=None)
        await asyncio.sleep(0.1)
        assert session.reporter is not None and not session.reporter.done(), "the reporter ended with the channel"

        # The next session: its stub gets the report, which stayed queued.
        service.release.set()
        second = grpc.aio.insecure_channel(config.scheduler)
        session.stub = agent_pb2_grpc.NodeServiceStub(second)
        session.connected.set()
        await _until(lambda: not state.pending_reports, what="the queued report sent on the next session")
        assert ("job-1", common_pb2.RANK_STATE_KILLED) in service.reports
        await second.close(grace=None)
    finally:
        await session.stop_reporter()
        await first.close(grace=None)
        await server.stop(0)


async def test_the_shutdown_flush_ends_with_a_report_still_in_flight(tmp_path):
    """The flush gives up after flush_timeout_s with the report unanswered: its channel closes under the call, the
    reporter waits for a stub that never comes (it neither ends nor spins), and stops when told."""
    service = _Service()  # never told to answer
    server = grpc.aio.server()
    agent_pb2_grpc.add_NodeServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = SimpleNamespace(
        node_name="node-s",
        scheduler=f"127.0.0.1:{port}",
        default_heartbeat_ms=1000,
        rpc_timeout_s=30.0,
        backoff_initial_s=0.01,
        backoff_cap_s=0.05,
        flush_timeout_s=0.3,
        token="",
        tls=None,
    )
    state = AgentState.load(tmp_path / "state.json", node_name="node-s")
    reports = ReportQueue(state)
    session = SchedulerSession(
        config,
        state,
        structlog.get_logger(),
        "instance-1",
        reports,
        ranks=SimpleNamespace(),
        devices=SimpleNamespace(),
        background=Background(),
        stop=asyncio.Event(),
        registration=dict,
    )
    try:
        reports.rank(RankRecord(job_id="job-2", attempt=1, rank=0), "killed", message="shutting down")
        await asyncio.wait_for(session.flush(), 10)
        assert service.held.is_set() and state.pending_reports  # sent, never answered: kept for the next start
        await asyncio.sleep(0.1)  # the reporter saw its call cancelled; the loop still runs
        assert session.reporter is not None and not session.reporter.done()
        await asyncio.wait_for(session.stop_reporter(), 5)
        assert session.reporter.done()
    finally:
        service.release.set()
        await session.stop_reporter()
        await server.stop(0)
