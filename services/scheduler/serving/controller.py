"""The service controller: the leader's loop that keeps every service at its desired state.

It reconciles (serving.commands.Reconcile, a command of the scheduling cycle) each service:
- soon after one of its replica jobs changes (a replica became ready, failed, was preempted): the fan-out of job
  changes wakes it (a listener, not a watcher: nothing buffered), so a rolling update moves on as soon as a new
  replica is ready;
- at least every `period_s` (a replica whose backoff ended, a failed submission);
- after every API change (`kick`).

The autoscaler runs here too: every service with an Autoscale policy is evaluated every its period_s, from the
metric values pushed (PushMetric) or scraped from its ready leaders (off the event loop, in a thread), through the
pure rule phalanx.core.autoscale.recommend; a new count is a ScaleService command of the cycle.

Only the leader runs it (a replica that does not lead would only fail its cycles' writes); its memory (the
autoscaler's recommendation history, pushed values) starts empty on a new leader, as HPA's does on a restart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from phalanx.api.v1 import common_pb2, service_pb2
from phalanx.core.autoscale import AutoscaleState, recommend
from phalanx.core.rollout import ReplicaView, plan_fleet
from services.common import metrics

from .autoscaling import MetricBook, period_of, policy_of, scrape
from .commands import Reconcile, ScaleService
from .views import leader_host, read_service_views

if TYPE_CHECKING:
    from ..service import SchedulerService

log = structlog.get_logger()


@dataclass
class _Scaled:
    state: AutoscaleState = field(default_factory=AutoscaleState)
    next_at: float = 0.0


def needs_reconcile(view: service_pb2.Service) -> bool:
    """Whether the fleet plan, from this read of the service, would start or stop a replica or say something new
    (the cycle's Reconcile plans again on its own view: this only spares a steady fleet its write)."""
    spec = view.spec
    replicas = [
        ReplicaView(r.index, r.revision, r.job_id, ready=r.ready, down=r.state == "FAILED") for r in view.replicas
    ]
    plan = plan_fleet(
        replicas, spec.replicas, view.revision, max_surge=spec.max_surge, max_unavailable=spec.max_unavailable
    )
    if plan.starts or plan.stops or plan.message != view.message:
        return True
    rolling = any(r.revision != view.revision for r in view.replicas if r.state != "FAILED")
    return not rolling and any(r.surge for r in view.replicas)  # a finished rollout's surge flags to clear


class ServiceController:
    def __init__(self, service: SchedulerService, period_s: float = 1.0) -> None:
        self.service = service
        self.period_s = period_s
        self.metrics = MetricBook()
        self.watches: dict[str, int] = {}
        self._scaled: dict[str, _Scaled] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._measured: set[str] = set()  # services whose gauges are set

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="service-controller")
        self.service.fanout.listen(self._on_job)

    async def stop(self) -> None:
        self.service.fanout.unlisten(self._on_job)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def _gauges(self, views: list[service_pb2.Service]) -> None:
        """phalanx_service_replicas for every live service; the series of services gone since are removed."""
        names = set()
        for view in views:
            name = view.spec.name
            names.add(name)
            live = sum(1 for r in view.replicas if r.state != "FAILED")
            metrics.SERVICE_REPLICAS.labels(name, "desired").set(view.spec.replicas)
            metrics.SERVICE_REPLICAS.labels(name, "live").set(live)
            metrics.SERVICE_REPLICAS.labels(name, "ready").set(view.ready_replicas)
        for gone in self._measured - names:
            for kind in ("desired", "live", "ready"):
                metrics.SERVICE_REPLICAS.remove(gone, kind)
        self._measured = names

    def kick(self) -> None:
        self._wake.set()

    def forget(self, name: str) -> None:
        self._scaled.pop(name, None)
        self.metrics.forget(name)

    def _on_job(self, job: common_pb2.Job) -> None:
        if job.service:  # one of a service's replicas changed: reconcile soon
            self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.period_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if not self.service.leading:
                continue
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next tick tries again; the controller must not die
                log.warning("service_controller_failed", error=str(exc)[:300])

    async def tick(self) -> None:
        views = await self.service.read_snapshot(read_service_views)  # the one read of a tick
        self._gauges(views)
        due = [v.spec.name for v in views if needs_reconcile(v)]
        if due:  # a steady fleet costs a read, never a write (nor a cycle)
            await self.service.execute(Reconcile(due))
        now = time.time()
        for view in views:
            if view.spec.HasField("autoscale") and view.spec.autoscale.max_replicas:
                await self._autoscale(view, now)

    async def _autoscale(self, view: service_pb2.Service, now: float) -> None:
        name, spec = view.spec.name, view.spec
        scaled = self._scaled.setdefault(name, _Scaled())
        if now < scaled.next_at:
            return
        scaled.next_at = now + period_of(spec.autoscale)
        policy = policy_of(spec.autoscale)
        ready = [r for r in view.replicas if r.ready]
        a = spec.autoscale
        if a.metrics_port:
            path = a.metrics_path or "/metrics"
            hosts = {r.index: leader_host(r, spec) for r in ready}
            got = await asyncio.gather(
                *(asyncio.to_thread(scrape, f"http://{h}:{a.metrics_port}{path}", a.metric) for h in hosts.values())
            )
            for index, scraped in zip(hosts, got, strict=True):
                if scraped is not None:
                    self.metrics.put(name, index, a.metric, scraped, now)
        values = self.metrics.per_replica(name, a.metric, [r.index for r in ready], now)
        current = spec.replicas
        rec = recommend(policy, current, values, now, scaled.state)
        if rec.replicas != current or rec.reason != view.autoscaler:
            if rec.replicas != current:
                log.info("service_autoscaled", service=name, replicas=rec.replicas, was=current, reason=rec.reason)
            await self.service.execute(ScaleService(name, rec.replicas, None, by_autoscaler=rec.reason))
