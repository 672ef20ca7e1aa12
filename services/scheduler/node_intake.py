"""What the agents tell a scheduler replica between its cycles: heartbeats (and the health, draining and MIG modes
they carry), acks of assignments, and rank reports.

None of it waits for a cycle. A heartbeat renews its node's lease in memory; the status lane (status_lane.py)
writes leases, acks and rank reports to the ledger in transactions of their own. What changes a decision's input
(a health change, a drain, a MIG mode, a rank report the view cannot judge) becomes a command for the next cycle,
queued once however often the agent repeats it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from services.common import metrics
from services.common.errors import Unavailable

from . import migmode
from .commands import HEALTH_NAMES, Drain, HealthReport, RankReport
from .settings import SchedulerSettings
from .stalls import StallWatch
from .state import SchedulerState
from .status_lane import StatusLane, lane_report
from .transitions import Command, Cycle

log = structlog.get_logger()


class Replica(Protocol):
    """What the intake needs of its scheduler replica (service.SchedulerService)."""

    state: SchedulerState
    settings: SchedulerSettings
    status_lane: StatusLane | None
    clock: Callable[[], float]

    @property
    def leading(self) -> bool: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def view_trusted(self) -> bool: ...
    async def execute(self, command: Command) -> Any: ...
    def enqueue(self, command: Command, on_done: Callable[[asyncio.Future], None], *, wake: bool = True) -> bool: ...


class NodeIntake:
    def __init__(self, service: Replica) -> None:
        self._service = service
        self.stalls = StallWatch()
        self.rank_reports: collections.Counter[str] = collections.Counter()  # by path: lane, answered, cycle
        self._beats: dict[str, float] = {}  # node -> its last heartbeat since the last cycle took them
        self._acks: dict[str, int] = {}  # node -> the highest revision it acked since the acks were last taken
        self._acks_taken = 0.0
        self._draining: set[str] = set()  # nodes whose Drain is queued
        self._health_queued: dict[str, tuple] = {}  # node -> health signature of a HealthReport not yet applied
        # --mig-manage (migmode.py): per node the highest revision it acked, that revision as of its last heartbeat,
        # and the signature of a MigModeReport not yet applied
        self.acked_seen: dict[str, int] = {}
        self._acked_at_beat: dict[str, int] = {}
        self._mig_queued: dict[str, tuple] = {}

    # ---- heartbeats --------------------------------------------------------------------------------------------

    def heartbeat(
        self, name: str, health=None, events=(), draining: bool = False, mig_modes=(), instance: str = ""
    ) -> tuple[str, bool]:
        """Record a heartbeat (no transaction: leases live in memory and reach the ledger every few seconds).
        Returns the node's state and whether its agent must register again.

        Health costs nothing while it stays the same. A change (or any health event) queues a HealthReport and wakes
        the loop, so the next cycle, at once and not a heartbeat later, takes FATAL GPUs out of placement."""
        service = self._service
        node = service.state.nodes.get(name)
        if node is None:
            return "UNKNOWN", True
        if instance and node.agent_instance and instance != node.agent_instance:
            return node.state, True  # a stale agent process: nothing it says counts until it registers again
        self._beats[name] = now = service.clock()
        lane = service.status_lane
        if lane is not None and now - node.persisted_heartbeat >= service.settings.heartbeat_persist_interval:
            node.persisted_heartbeat = now  # the lane writes it (status_lane.py): no cycle does
            lane.note_status({node.id: now}, {})
        if draining and node.state == "READY" and name not in self._draining:
            drain = Drain(name, "the agent is draining (SIGTERM): it takes no new work")
            if service.enqueue(drain, functools.partial(_discard_later, self._draining, name)):
                self._draining.add(name)
        if node.state != "LOST" and (events or (health is not None and health.state in HEALTH_NAMES)):
            self._queue_health(node, health, list(events))
        elif node.health == "UNKNOWN" and node.state == "READY" and name not in self._health_queued:
            # Back after it was lost, and its agent runs no health monitor: this heartbeat is its health report.
            report = HealthReport(name, None, [], alive=True)
            if service.enqueue(report, functools.partial(_pop_later, self._health_queued, name)):
                self._health_queued[name] = ("HEALTHY", "", {})
        if node.mig_manage and node.state != "LOST":
            self._queue_mig(node, mig_modes)
        return node.state, node.state == "LOST"

    def _queue_mig(self, node, mig_modes) -> None:
        """A --mig-manage agent's MIG modes: queue a MigModeReport when they change the view (a mode, a pending
        mode, the end of a switch). Errors count only once the agent had acked the switch before its previous
        heartbeat (migmode.py)."""
        gate = self._acked_at_beat.get(node.name, 0)
        self._acked_at_beat[node.name] = max(self.acked_seen.get(node.name, 0), node.acked_revision)
        if not self._service.accepting:
            return
        statuses = migmode.statuses_from_proto(mig_modes)
        try:
            changed = bool(migmode.report_changes(node, statuses, gate))
        except RuntimeError:  # the writer thread changed the record meanwhile: let the cycle decide
            changed = True
        if not changed:
            return
        sig = (tuple(sorted(statuses.items())), gate)
        if self._mig_queued.get(node.name) == sig:
            return  # the same report is queued for the next cycle already
        self._mig_queued[node.name] = sig

        def done(f: asyncio.Future, name=node.name, sig=sig) -> None:
            if self._mig_queued.get(name) == sig:
                self._mig_queued.pop(name, None)
            if not f.cancelled() and f.exception() is not None:
                log.warning("mig_mode_report_failed", node=name, error=str(f.exception())[:200])

        self._service.enqueue(migmode.MigModeReport(node.name, statuses, gate), done)

    def _queue_health(self, node, health, events: list) -> None:
        if health is not None and health.state in HEALTH_NAMES:
            sig = (
                HEALTH_NAMES[health.state],
                health.reason,
                {
                    g.index: (HEALTH_NAMES.get(g.state, "DEGRADED"), tuple(g.reasons))
                    for g in health.gpus
                    if g.state in (2, 3)
                },
            )
        else:
            health, sig = None, None
        current = self._health_queued.get(node.name) or (node.health, node.health_reason, node.gpu_health)
        if not events and (sig is None or sig == current):
            return
        if not self._service.accepting:
            return
        if sig is not None:
            self._health_queued[node.name] = sig

        def done(f: asyncio.Future, name=node.name, sig=sig) -> None:
            if self._health_queued.get(name) == sig:
                self._health_queued.pop(name, None)  # applied, or failed: the next heartbeat compares again
            if not f.cancelled() and f.exception() is not None:
                log.warning("health_report_failed", node=name, error=str(f.exception())[:200])

        self._service.enqueue(HealthReport(node.name, health, events), done)

    # ---- assignments -------------------------------------------------------------------------------------------

    def revision_of(self, name: str) -> float:
        """The node's last assignment revision as this replica's view has it; inf when the view does not know
        the node (or is being reloaded): the caller reads the ledger."""
        node = self._service.state.nodes.get(name)
        return float("inf") if node is None or not self._service.view_trusted else node.revision

    def ack(self, name: str, revision: int) -> bool:
        """The agent acked its assignments up to `revision`; False when the node is not known."""
        node = self._service.state.nodes.get(name)
        if node is None:
            return False
        lane = self._service.status_lane
        if lane is not None and revision > node.acked_revision:
            lane.note_status({}, {node.id: revision})
        self._acks[name] = max(revision, self._acks.get(name, 0))
        self.acked_seen[name] = max(revision, self.acked_seen.get(name, 0))
        return True

    # ---- rank reports ------------------------------------------------------------------------------------------

    async def report_rank(self, report: RankReport) -> bool:
        """An agent's rank report; True when the rank is stale (the agent stops it). On the leader the status lane
        takes it (status_lane.py): answered from the view when nothing is to be written, else once its row commits,
        never after a cycle; the cycle applies it after (woken when it changes a decision's input). What the view
        cannot judge alone is a cycle command, as on a replica that does not lead."""
        service = self._service
        lane = service.status_lane
        if lane is None or not service.leading or not service.view_trusted:
            self._count_report("cycle")
            return await service.execute(report)
        what, wake, row = lane_report(service.state, report, service.clock())
        if what in ("stale", "same"):
            self._count_report("answered")
            return what == "stale" and report.state == "RUNNING"
        if what == "cycle" or row is None:
            self._count_report("cycle")
            return await service.execute(report)
        try:
            await lane.record_rank(row)
        except Exception as exc:  # nothing was recorded: the agent sends it again
            raise Unavailable("the ledger is unavailable; the report was not recorded, send it again") from exc
        self._count_report("lane")
        # (when the service stops first, the next leader settles it from the ledger)
        service.enqueue(
            dataclasses.replace(report, recorded=True),
            functools.partial(log_failure, "recorded_rank_report_failed", report.job_id),
            wake=wake,
        )
        return False

    def _count_report(self, path: str) -> None:
        self.rank_reports[path] += 1
        metrics.RANK_REPORTS.labels(path).inc()

    # ---- into the cycle (writer thread) ------------------------------------------------------------------------

    def take_beats_and_acks(self, cycle: Cycle) -> None:
        """Fold the heartbeats and acks heard since the last cycle into the view, and the stall time into every
        lease; without the status lane, have the cycle persist them when due."""
        service = self._service
        nodes = service.state.nodes
        if service.clock is time.time:  # a clock the caller drives does not run on while this process is stalled
            credit = self.stalls.take_credit()
            if credit > 0:
                for each in nodes.values():
                    each.last_heartbeat += credit
                if credit >= 0.25:
                    log.info("scheduler_stalled", seconds=round(credit, 3), note="every node's lease is extended")
        beats, self._beats = self._beats, {}
        if cycle.now - self._acks_taken >= 1.0:
            acks, self._acks = self._acks, {}
            self._acks_taken = cycle.now
        else:
            acks = {}
        persist_every = service.settings.heartbeat_persist_interval
        lane = service.status_lane is not None  # then the handlers gave the lane what to write (heartbeat, ack)
        for name, ts in beats.items():
            node = nodes.get(name)
            if node is None:
                continue
            node.last_heartbeat = max(node.last_heartbeat, ts)
            if not lane and ts - node.persisted_heartbeat >= persist_every:
                cycle.work.heartbeats[node.id] = ts
                node.persisted_heartbeat = ts
        if lane:
            for n, r in acks.items():
                if n in nodes:
                    nodes[n].acked_revision = max(nodes[n].acked_revision, r)
            return
        # Only acks that raise what the view has: an ack of a revision already acked changes nothing, and a cycle
        # that wrote it would still commit (a new ledger generation, a change-log row) for nothing.
        cycle.work.acks = {nodes[n].id: r for n, r in acks.items() if n in nodes and r > nodes[n].acked_revision}


def _discard_later(names: set[str], name: str, _done: asyncio.Future) -> None:
    """A queued command's future is done: `name` may be queued again."""
    names.discard(name)


def _pop_later(queued: dict, name: str, _done: asyncio.Future) -> None:
    queued.pop(name, None)


def log_failure(event: str, job_id: str, done: asyncio.Future) -> None:
    """A done callback for a queued command no caller waits for: log its failure."""
    if not done.cancelled() and done.exception() is not None:
        log.warning(event, job=job_id, error=str(done.exception())[:200])
