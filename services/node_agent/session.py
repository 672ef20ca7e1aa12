"""The scheduler session: the node agent's side of NodeService (proto/phalanx/api/v1/agent.proto).

- RegisterNode with a fresh agent_instance per process; Heartbeat every heartbeat_interval_ms; a heartbeat
  answered `reregister` (or any RPC failure) ends the session and the agent registers again, moving on to the next
  `--scheduler` address, with exponential backoff and jitter (capped at backoff_cap_s).
- StreamAssignments from the last revision acked in the local state file. Each assignment is applied
  idempotently by the rank supervisor (through the `RankControl` protocol), the state file is written, and only
  then AckAssignments(revision).
- The reporter sends the persisted report queue (reports.py) with ReportRankStatus / ReportAttemptReleased /
  ReportReadiness until the scheduler takes each item; a rank report answered `stale` kills the rank, a readiness
  report answered `stale` stops the attempt's probe (readiness.py).
- Ledger identity (check_ledger): saved state of another cluster id, or ahead of the ledger's revision, is
  another ledger's: its ranks are killed and forgotten and the agent streams from revision 0.
- Self-fencing (fence_watch): a node whose registration is not renewed within the lease stops its ranks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import grpc

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc, common_pb2

from ._background import Background
from .devices import DeviceGlue
from .reports import REPORTS_PENDING, ReportQueue
from .state import AgentState, RankRecord, attempt_key, rank_key

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.enable_retries", 0),
]

# Report errors that retrying cannot fix; anything else (UNAVAILABLE, NOT_FOUND while the scheduler forgot the
# node, DEADLINE_EXCEEDED, ...) is retried with backoff.
_PERMANENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

_STATE_ENUM = {
    "running": common_pb2.RANK_STATE_RUNNING,
    "exited": common_pb2.RANK_STATE_EXITED,
    "failed": common_pb2.RANK_STATE_FAILED_TO_START,
    "killed": common_pb2.RANK_STATE_KILLED,
    "lost": common_pb2.RANK_STATE_LOST,
}


class _Reregister(Exception):
    """Register again at once (heartbeat said `reregister`)."""


class _StreamEnded(Exception):
    """The scheduler closed the assignment stream: reconnect after a backoff."""


def backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Exponential backoff with full jitter in [base/2, base], base = min(cap, initial * 2**attempt)."""
    base = min(cap, initial * (2 ** min(attempt, 30)))
    return random.uniform(base / 2, base)


class RankControl(Protocol):
    """What the session asks of the host's ranks (the rank supervisor, supervisor.py)."""

    def live_attempts(self) -> list[str]: ...

    def prepare_launch(self, launch: agent_pb2.LaunchReplica) -> list[RankRecord]: ...

    def prepare_kill(self, kill: agent_pb2.KillJob) -> None: ...

    async def start(self, records: list[RankRecord], command: Any, launch: Any) -> None: ...

    async def stop_attempt(self, job_id: str, attempt: int, reason: str) -> None: ...

    async def kill_rank(self, rec: RankRecord, reason: str) -> None: ...

    async def discard(self, why: str) -> None: ...


class SchedulerSession:
    def __init__(
        self,
        config: Any,
        state: AgentState,
        log: Any,
        instance: str,
        reports: ReportQueue,
        ranks: RankControl,
        devices: DeviceGlue,
        background: Background,
        stop: asyncio.Event,
        registration: Callable[[], dict],
        readiness_stale: Callable[[str, int], None] | None = None,
    ) -> None:
        self.config = config
        self.node_name = config.node_name
        self.state = state
        self.log = log
        self.instance = instance
        self.reports = reports
        self.ranks = ranks
        self.devices = devices
        self.background = background
        self._stop = stop
        self.registration = registration  # the host's fields of RegisterNodeRequest (containment, resources, logs)
        # Told when a readiness report is answered `stale` (the attempt is not the job's running one): the prober
        # stops probing it (readiness.py).
        self.readiness_stale = readiness_stale
        # `--scheduler host1:port,host2:port`: the replicas, tried in turn (any replica takes an agent; see
        # docs/design.md, "Leadership"). A failed session moves on to the next address.
        self.schedulers = [t.strip() for t in config.scheduler.split(",") if t.strip()] or [config.scheduler]
        self._scheduler_index = 0
        self.attempt = 0  # failed connection attempts in a row
        self.stub: agent_pb2_grpc.NodeServiceStub | None = None
        self.connected = asyncio.Event()
        self.reporter: asyncio.Task | None = None
        self.registrations = 0  # successful RegisterNode calls (for tests / introspection)
        self.logs_key = ""  # from the registration: the key log credentials are checked with (logs.py)
        self.heartbeat_interval_ms = config.default_heartbeat_ms
        # Self-fencing: when the last heartbeat the scheduler answered was sent (monotonic), the node lease it gave,
        # whether this agent fenced itself since (until it registers again), and after how long a silence it did.
        self.renewed_at: float | None = None
        self.lease_s = 0.0
        self.fenced = False
        self.fenced_after = 0.0

    def open_channel(self) -> grpc.aio.Channel:
        from phalanx.client import open_aio_channel

        return open_aio_channel(self.scheduler, CHANNEL_OPTIONS, token=self.config.token, tls=self.config.tls)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- connection

    @property
    def scheduler(self) -> str:
        """The scheduler address this agent uses now (one of `--scheduler`'s comma-separated list)."""
        return self.schedulers[self._scheduler_index]

    def _next_scheduler(self) -> bool:
        """Move on to the next scheduler address; True when that starts a new round through the list."""
        self._scheduler_index = (self._scheduler_index + 1) % len(self.schedulers)
        if len(self.schedulers) > 1:
            self.log.info("scheduler_failover", next=self.scheduler)
        return self._scheduler_index == 0

    async def supervise(self) -> None:
        """Sessions, one after another, until the agent stops."""
        self.attempt = 0
        while not self._stop.is_set():
            try:
                await self._session()
                continue
            except _Reregister:
                self.log.info("reregistering")
                continue
            except _StreamEnded:
                self.log.warning("assignment_stream_ended", attempt=self.attempt)
            except grpc.aio.AioRpcError as exc:
                self.log.warning(
                    "scheduler_unreachable", code=exc.code().name, detail=exc.details(), attempt=self.attempt
                )
            except (OSError, grpc.RpcError) as exc:
                self.log.warning("scheduler_connection_error", error=str(exc), attempt=self.attempt)
            except Exception:  # a bug must not end the daemon; log it and reconnect
                self.log.exception("agent_session_error", attempt=self.attempt)
            if self._stop.is_set():
                break
            if self._next_scheduler() or len(self.schedulers) == 1:
                delay = backoff_delay(self.attempt, self.config.backoff_initial_s, self.config.backoff_cap_s)
                self.attempt += 1
            else:  # another replica not yet tried in this round: at once (after the shortest backoff)
                delay = backoff_delay(0, self.config.backoff_initial_s, self.config.backoff_cap_s)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def _register(self, stub) -> agent_pb2.RegisterNodeResponse:
        topology = await asyncio.to_thread(self.devices.current_topology)
        sent = time.monotonic()
        resp = await stub.RegisterNode(
            agent_pb2.RegisterNodeRequest(
                node_name=self.node_name,
                topology=topology,
                address=self.config.address,
                agent_instance=self.instance,
                mig_manage=self.config.mig_manage,
                confirms_release=True,
                rank_port_low=self.config.rank_ports[0],
                rank_port_high=self.config.rank_ports[1],
                live_attempts=self.ranks.live_attempts(),
                **self.registration(),
            ),
            timeout=self.config.rpc_timeout_s,
        )
        self.registrations += 1
        self.logs_key = resp.logs_key
        self.attempt = 0
        self.renewed_at, self.lease_s = sent, resp.lease_timeout_ms / 1000
        if self.fenced:
            self.log.info("fence_lifted", note="registered again; the scheduler has requeued the fenced gangs")
            self.fenced = False
        self.heartbeat_interval_ms = resp.heartbeat_interval_ms or self.config.default_heartbeat_ms
        self.log.info(
            "registered",
            scheduler=self.scheduler,
            heartbeat_ms=self.heartbeat_interval_ms,
            scheduler_acked=resp.acked_revision,
            local_acked=self.state.acked_revision,
            cluster_id=resp.cluster_id or "unknown",
        )
        return resp

    async def _session(self) -> None:
        channel = self.open_channel()
        stub = agent_pb2_grpc.NodeServiceStub(channel)
        tasks: list[asyncio.Task] = []
        try:
            resp = await self._register(stub)
            # Heartbeats from now on: killing another ledger's ranks (check_ledger) may take a kill grace period.
            tasks = [asyncio.create_task(self._heartbeat_loop(stub), name="heartbeat")]
            await self.check_ledger(resp)
            if resp.acked_revision < self.state.acked_revision:
                await stub.AckAssignments(
                    agent_pb2.AckAssignmentsRequest(node_name=self.node_name, revision=self.state.acked_revision),
                    timeout=self.config.rpc_timeout_s,
                )
            self.stub = stub
            self.connected.set()
            self.reports.changed.set()
            tasks += [
                asyncio.create_task(self._consume(stub), name="assignments"),
                asyncio.create_task(self._stop.wait(), name="stop"),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.get_name() != "stop" and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if not self._stop.is_set():
                raise _StreamEnded()
        finally:
            self.connected.clear()
            self.stub = None
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await channel.close(grace=None)

    async def _heartbeat_loop(self, stub) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_ms / 1000)
            await self.devices.check_health()
            req = agent_pb2.HeartbeatRequest(node_name=self.node_name, agent_instance=self.instance)
            events = await self.devices.fill_heartbeat(req)
            at = time.monotonic()
            resp = await stub.Heartbeat(req, timeout=self.config.rpc_timeout_s)
            if not resp.reregister:
                self.renewed_at = at
            self.devices.heartbeat_answered(events)
            if resp.reregister:
                raise _Reregister()

    async def _consume(self, stub) -> None:
        call = stub.StreamAssignments(
            agent_pb2.StreamAssignmentsRequest(node_name=self.node_name, after_revision=self.state.acked_revision)
        )
        async for assignment in call:
            if self._stop.is_set():
                return
            await self._take(stub, assignment)

    async def _take(self, stub, a: agent_pb2.Assignment) -> None:
        kind = a.WhichOneof("action")
        if a.revision and a.revision <= self.state.acked_revision:
            # Applied already (revisions are applied in order and acked once on disk): a finished rank's record
            # may be gone, so a re-sent launch must not start it again.
            self.log.info("assignment_already_applied", revision=a.revision, action=kind)
            return
        started: list[RankRecord] = []
        if kind == "launch":
            started = self.ranks.prepare_launch(a.launch)
        elif kind == "kill":
            self.ranks.prepare_kill(a.kill)
        elif kind == "set_mig_mode":
            self.background.spawn(self.devices.switch_mig_mode(a.set_mig_mode))
        else:
            self.log.warning("unknown_assignment", revision=a.revision)
        self.state.acked_revision = max(self.state.acked_revision, a.revision)
        self.state.save()  # durable before the ack
        launch = a.launch if kind == "launch" else None
        await self.ranks.start(started, a.launch.command if launch is not None else [], launch)
        await self.state.durable()  # the launch's records and the revision are on disk before the ack
        if kind == "kill":
            reason = a.kill.reason or "killed by the scheduler"
            self.background.spawn(self.ranks.stop_attempt(a.kill.job_id, a.kill.attempt, reason))
        await stub.AckAssignments(
            agent_pb2.AckAssignmentsRequest(node_name=self.node_name, revision=self.state.acked_revision),
            timeout=self.config.rpc_timeout_s,
        )
        self.log.info("assignment_acked", revision=a.revision, action=kind)

    # ---------------------------------------------------------------- ledger identity

    async def check_ledger(self, resp: agent_pb2.RegisterNodeResponse) -> None:
        """Is the saved state this ledger's? Its revisions count in one ledger only: state of another one (a new
        database, the same node name) would make the agent skip every assignment of this one as already taken.

        Another ledger: the saved cluster id differs from the one the scheduler returned; or, whatever the ids, the
        saved acked revision is above the node's last revision in the ledger (the agent cannot have taken a revision
        the ledger never wrote), which also covers state that has no cluster id (written by an older agent).
        Either way the agent kills that state's ranks, forgets it and starts from revision 0. Then it keeps the
        ledger's id. A scheduler that sends no id (an older one) leaves everything as it was."""
        ledger_id, saved = resp.cluster_id, self.state.cluster_id
        ledger_revision = resp.revision if resp.HasField("revision") else None
        about = dict(
            saved_cluster_id=saved or "unknown",
            ledger_cluster_id=ledger_id or "unknown",
            saved_acked_revision=self.state.acked_revision,
            ledger_revision=ledger_revision,
            ranks=len(self.state.ranks),
            state_file=str(self.state.path),
            action="killing its ranks and starting clean",
        )
        if ledger_id and saved and ledger_id != saved:
            self.log.warning("agent_state_from_another_ledger", **about)
            await self.start_clean(f"the node's state belongs to another ledger (cluster {saved}, now {ledger_id})")
        elif ledger_revision is not None and self.state.acked_revision > ledger_revision:
            self.log.warning("agent_state_ahead_of_ledger", **about)
            await self.start_clean(
                f"the node's saved state (revision {self.state.acked_revision}) is ahead of the "
                f"ledger (revision {ledger_revision}): stale"
            )
        if ledger_id and self.state.cluster_id != ledger_id:
            if not saved:
                self.log.info("ledger_identity_saved", cluster_id=ledger_id)
            self.state.cluster_id = ledger_id
            self.state.save()

    async def start_clean(self, why: str) -> None:
        """Forget another ledger's state: its ranks are killed (adopted processes included) and settled without a
        report (that ledger is not this scheduler's), their status files removed, and the revision reset to 0. The
        rank logs stay. MIG instances and MPS daemons the killed ranks used are released as usual."""
        await self.ranks.discard(why)
        for rec in self.state.ranks.values():
            if rec.status_file:
                Path(rec.status_file).unlink(missing_ok=True)
        forgotten = len(self.state.ranks)
        self.state.ranks.clear()
        self.state.killed_attempts.clear()
        dropped = self.reports.clear()
        self.state.oom_seen.clear()
        self.state.probes.clear()  # their probes end with their ranks
        self.state.acked_revision = 0
        self.state.save()
        self.log.warning(
            "agent_state_reset", reason=why, ranks_forgotten=forgotten, reports_dropped=dropped, acked_revision=0
        )

    # ---------------------------------------------------------------- self-fencing

    def fence_after_s(self) -> float:
        """How long without a renewal before the agent stops its ranks: early enough that they are gone (after
        --kill-grace) by the time the scheduler's lease on this node runs out and it requeues their gangs."""
        lease = self.lease_s
        return max(lease / 2, lease - self.config.kill_grace_s - 1.0)

    async def fence_watch(self) -> None:
        """A node cut off from the scheduler stops its ranks before their gangs can run anywhere else: a
        partitioned node never runs a gang twice. --no-self-fence turns it off."""
        while True:
            await asyncio.sleep(max(0.05, min(0.5, self.lease_s / 20)))
            if not self.config.self_fence or self.fenced or self.renewed_at is None or self.lease_s <= 0:
                continue
            silent = time.monotonic() - self.renewed_at
            if silent <= self.fence_after_s():
                continue
            live = sorted({(r.job_id, r.attempt) for r in self.state.ranks.values() if not r.final})
            self.fenced, self.fenced_after = True, silent
            self.log.warning(
                "self_fenced",
                why=f"no heartbeat renewed for {silent:.1f}s of a {self.lease_s:g}s node lease: the scheduler "
                "will requeue this node's gangs, so their ranks here are stopped",
                attempts=[attempt_key(j, a) for j, a in live],
            )
            for job_id, attempt in live:
                self.background.spawn(
                    self.ranks.stop_attempt(job_id, attempt, "the node fenced itself (scheduler unreachable)")
                )

    # ---------------------------------------------------------------- reports

    def start_reporter(self) -> None:
        self.reporter = asyncio.create_task(self._report_loop(), name="reporter")

    async def stop_reporter(self) -> None:
        if self.reporter is not None:
            self.reporter.cancel()
            await asyncio.gather(self.reporter, return_exceptions=True)

    async def _send(self, stub, item: dict) -> Any:
        if item.get("kind") == "ready":
            return await stub.ReportReadiness(
                agent_pb2.ReportReadinessRequest(
                    node_name=self.node_name,
                    agent_instance=self.instance,
                    job_id=item["job_id"],
                    attempt=item["attempt"],
                    ready=bool(item["ready"]),
                    message=item.get("message", ""),
                ),
                timeout=self.config.rpc_timeout_s,
            )
        if item.get("kind") == "released":
            return await stub.ReportAttemptReleased(
                agent_pb2.ReportAttemptReleasedRequest(
                    node_name=self.node_name,
                    agent_instance=self.instance,
                    job_id=item["job_id"],
                    attempt=item["attempt"],
                ),
                timeout=self.config.rpc_timeout_s,
            )
        return await stub.ReportRankStatus(
            agent_pb2.ReportRankStatusRequest(
                node_name=self.node_name,
                job_id=item["job_id"],
                attempt=item["attempt"],
                rank=item["rank"],
                state=_STATE_ENUM[item["state"]],
                exit_code=item["exit_code"],
                message=item["message"],
                pid=item["pid"],
                retryable=bool(item.get("retryable", False)),
                agent_instance=self.instance,
            ),
            timeout=self.config.rpc_timeout_s,
        )

    @staticmethod
    def _cancelling() -> bool:
        """Whether the running task itself was asked to stop (as opposed to a call of it cancelled under it)."""
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0

    async def _report_loop(self) -> None:
        attempt = 0
        while True:
            if not self.state.pending_reports:
                self.reports.changed.clear()
                await self.reports.changed.wait()
                continue
            stub = self.stub
            if stub is None:
                await self.connected.wait()
                continue
            item = self.state.pending_reports[0]
            kind = item.get("kind", "rank")  # rank | released | ready
            what = (
                rank_key(item["job_id"], item["attempt"], item["rank"])
                if kind == "rank"
                else f"{item['job_id']}/{item['attempt']} {kind}"
            )
            try:
                resp = await self._send(stub, item)
            except asyncio.CancelledError:
                if self._cancelling():
                    raise
                # Not this task's cancellation: the session ended and closed its channel under the call (grpc.aio
                # cancels a closed channel's calls). The report stays queued for the next session's stub.
                self.log.info("report_retry", rank=what, error="the session's channel closed", attempt=attempt)
                await asyncio.sleep(backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_cap_s))
                attempt += 1
                continue
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _PERMANENT:
                    # Retrying cannot help (e.g. the scheduler has no such rank on this node): drop it, say so.
                    self.log.warning(
                        "report_rejected",
                        rank=what,
                        state=item.get("state", kind),
                        code=exc.code().name,
                        detail=exc.details(),
                    )
                    if self.state.pending_reports and self.state.pending_reports[0] is item:
                        self.state.pending_reports.pop(0)
                        self.state.save()
                    continue
                self.log.info("report_retry", rank=what, error=exc.code().name, attempt=attempt)
                await asyncio.sleep(backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_cap_s))
                attempt += 1
                continue
            except Exception as exc:  # any other failure: keep the report and retry
                self.log.info("report_retry", rank=what, error=repr(exc), attempt=attempt)
                await asyncio.sleep(backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_cap_s))
                attempt += 1
                continue
            attempt = 0
            if self.state.pending_reports and self.state.pending_reports[0] is item:
                self.state.pending_reports.pop(0)
                if kind == "rank" and item["state"] != "running":  # its last report: the scheduler has its end
                    self.state.forget(rank_key(item["job_id"], item["attempt"], item["rank"]))
                self.state.save()
                REPORTS_PENDING.set(len(self.state.pending_reports))
            if kind == "ready" and resp.stale and self.readiness_stale is not None:
                self.readiness_stale(item["job_id"], item["attempt"])
            elif kind == "rank" and resp.stale:
                rec = self.state.ranks.get(rank_key(item["job_id"], item["attempt"], item["rank"]))
                if rec is not None and not rec.final:
                    self.log.info("stale_rank", rank=rec.key)
                    self.state.killed_attempts.add(attempt_key(rec.job_id, rec.attempt))
                    self.background.spawn(self.ranks.kill_rank(rec, "attempt superseded (stale)"))

    # ---------------------------------------------------------------- shutdown

    async def announce_drain(self) -> None:
        """Tell the scheduler this node takes no more work (a heartbeat with `draining`), best effort."""
        if self.registrations == 0:
            return
        channel = self.open_channel()
        try:
            req = agent_pb2.HeartbeatRequest(node_name=self.node_name, agent_instance=self.instance, draining=True)
            self.devices.drain_health(req)
            await agent_pb2_grpc.NodeServiceStub(channel).Heartbeat(req, timeout=min(2.0, self.config.rpc_timeout_s))
            self.log.info("drain_announced")
        except Exception as exc:  # the lease covers a scheduler we cannot reach
            self.log.warning("drain_not_announced", error=repr(exc)[:200])
        finally:
            await channel.close(grace=None)

    async def flush(self) -> None:
        """At shutdown: send the queued reports on a fresh channel, for at most flush_timeout_s."""
        if not self.state.pending_reports:
            return
        channel = self.open_channel()
        self.stub = agent_pb2_grpc.NodeServiceStub(channel)
        self.connected.set()
        # A fresh reporter on the new channel: the old one may sit in a call on the old channel (until its RPC
        # timeout) or in a retry backoff, either as long as the whole flush. A report it had in flight stays
        # pending until answered, so at worst it is sent twice (the scheduler takes a repeat as a no-op).
        await self.stop_reporter()
        self.start_reporter()
        self.reports.changed.set()
        deadline = time.monotonic() + self.config.flush_timeout_s
        while self.state.pending_reports and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.connected.clear()  # the reporter waits (not spins) while it has no stub
        self.stub = None
        await channel.close(grace=None)
        if self.state.pending_reports:
            self.log.warning(
                "reports_unsent",
                count=len(self.state.pending_reports),
                note="kept in the state file; sent by the next agent start",
            )
