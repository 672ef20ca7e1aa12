"""The ServiceService gRPC API (proto/phalanx/api/v1/service.proto): checks every request before anything is
written, runs each change as a command of the scheduling cycle, and answers with the service read back."""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

import structlog

from phalanx.api.v1 import common_pb2, service_pb2, service_pb2_grpc
from services.common.auth import SERVICES as SERVICES_PREFIX
from services.common.auth import audit_admin, current_identity, tenant_scope
from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.common.rpc import stream, unary

from .. import ledger
from ..servicer import tier_choices, validate_spec
from .commands import CreateService, DeleteService, RollbackService, ScaleService, UpdateService
from .spec import MAX_SERVICE_REPLICAS, name_problems, normalize_roles, service_problems
from .views import endpoints_of, read_service_views

if TYPE_CHECKING:
    from ..service import SchedulerService
    from .controller import ServiceController

log = structlog.get_logger()


def _caller() -> tuple[str, bool]:
    ident = current_identity()
    return (ident.tenant if ident is not None else ""), (ident is None or ident.admin)


def check_template(template: common_pb2.JobSpec, name: str, service: SchedulerService) -> None:
    """The replica template must be a valid job (its name defaults to the service's)."""
    normalize_roles(template)
    probe = common_pb2.JobSpec()
    probe.CopyFrom(template)
    probe.name = probe.name or name or "service"
    if probe.restart == "none":
        probe.restart = "never"
    validate_spec(probe, service.settings.fabric.tiers, service.settings)


class ServiceServicer(service_pb2_grpc.ServiceServiceServicer):
    def __init__(self, service: SchedulerService, controller: ServiceController) -> None:
        self.service = service
        self.controller = controller

    async def _view(self, name: str, *, revisions: bool = False) -> service_pb2.Service:
        views = await self.service.read_snapshot(
            read_service_views, names=[name], tenant=tenant_scope(), revisions=revisions
        )
        if not views:
            raise NotFound(f"no service named {name[:64]!r}")
        return views[0]

    async def _owned(self, name: str) -> None:
        """NOT_FOUND for an unknown service or another tenant's, from one row: checked before a change goes to the
        cycle, so that a refusal writes nothing (not even a cycle)."""
        scope = tenant_scope()
        rows = await self.service.read_snapshot(ledger.read_services, names=[name])
        if not rows or (scope is not None and rows[0]["tenant"] != scope):
            raise NotFound(f"no service named {name[:64]!r}")

    def _check_spec(self, spec: service_pb2.ServiceSpec) -> None:
        problems = service_problems(spec, tier_choices(self.service.settings.fabric.tiers))
        if problems:
            raise InvalidArgument("invalid service: " + "; ".join(problems))
        check_template(spec.template, spec.name, self.service)

    async def _create(self, spec: service_pb2.ServiceSpec, apply: bool) -> service_pb2.Service:
        self._check_spec(spec)
        tenant, admin = _caller()
        name = await self.service.execute(CreateService(spec, tenant, admin, apply=apply))
        self.controller.kick()
        audit_admin(SERVICES_PREFIX + ("ApplyService" if apply else "CreateService"), f"service/{name}")
        return await self._view(name)

    @unary
    async def CreateService(self, request, context):
        return await self._create(request.spec, apply=False)

    @unary
    async def ApplyService(self, request, context):
        return await self._create(request.spec, apply=True)

    @unary
    async def GetService(self, request, context):
        return await self._view(request.name, revisions=True)

    @unary
    async def ListServices(self, request, context):
        views = await self.service.read_snapshot(read_service_views, tenant=tenant_scope())
        return service_pb2.ListServicesResponse(services=views)

    @unary
    async def UpdateService(self, request, context):
        problems = name_problems(request.name)
        for field in ("max_surge", "max_unavailable"):
            if request.HasField(field) and getattr(request, field) < 0:
                problems.append(f"{field} cannot be negative")
        if problems:
            raise InvalidArgument("invalid update: " + "; ".join(problems))
        if request.template.time_limit_s or request.template.max_restarts:
            raise InvalidArgument("invalid update: a service's replicas take no time_limit_s or max_restarts")
        check_template(request.template, request.name, self.service)
        await self._owned(request.name)
        _, admin = _caller()
        command = UpdateService(
            request.name,
            request.template,
            tenant_scope(),
            admin,
            max_surge=request.max_surge if request.HasField("max_surge") else None,
            max_unavailable=request.max_unavailable if request.HasField("max_unavailable") else None,
        )
        await self.service.execute(command)
        self.controller.kick()
        return await self._view(request.name)

    @unary
    async def ScaleService(self, request, context):
        if not 0 <= request.replicas <= MAX_SERVICE_REPLICAS:
            raise InvalidArgument(f"replicas must be 0-{MAX_SERVICE_REPLICAS}, got {request.replicas}")
        await self._owned(request.name)
        await self.service.execute(ScaleService(request.name, request.replicas, tenant_scope()))
        self.controller.kick()
        return await self._view(request.name)

    @unary
    async def RollbackService(self, request, context):
        if request.revision < 0:
            raise InvalidArgument(f"revision must be 0 (the previous one) or a revision number, got {request.revision}")
        await self._owned(request.name)
        _, admin = _caller()
        await self.service.execute(RollbackService(request.name, request.revision, tenant_scope(), admin))
        self.controller.kick()
        return await self._view(request.name)

    @unary
    async def DeleteService(self, request, context):
        """Idempotent: deleting a deleted service answers it as it is (as cancelling a cancelled job does)."""

        async def read() -> service_pb2.Service:
            views = await self.service.read_snapshot(
                read_service_views, names=[request.name], tenant=tenant_scope(), deleted=True
            )
            if not views:
                raise NotFound(f"no service named {request.name[:64]!r}")
            return views[0]

        if (await read()).deleted:
            return await read()
        await self.service.execute(DeleteService(request.name, tenant_scope()))
        self.controller.forget(request.name)
        return await read()

    @unary
    async def PushMetric(self, request, context):
        if not request.metric or len(request.metric) > 200:
            raise InvalidArgument("metric must be a name of 1-200 characters")
        if not math.isfinite(request.value):
            raise InvalidArgument(f"value must be a finite number, got {request.value}")
        if request.replica < -1:
            raise InvalidArgument(f"replica must be -1 (the whole service) or an index, got {request.replica}")
        await self._owned(request.service)
        self.controller.metrics.put(request.service, request.replica, request.metric, request.value)
        return service_pb2.PushMetricResponse()

    @stream
    async def WatchEndpoints(self, request, context):
        service = await self._view(request.name)
        ident = current_identity()
        caller = ident.tenant if ident is not None else f"peer {context.peer()}"
        if self.controller.watches.get(caller, 0) >= self.service.settings.max_watches:
            raise ResourceExhausted(
                f"{caller} has {self.service.settings.max_watches} watch streams open (--max-watches)"
            )
        self.controller.watches[caller] = self.controller.watches.get(caller, 0) + 1
        entry = self.service.fanout.subscribe(None, tenant_scope())
        try:
            last = endpoints_of(service)
            yield service_pb2.Endpoints(service=request.name, endpoints=last, at=time.time())
            while True:
                got = await entry.get()
                if got is None:
                    raise ResourceExhausted("this watcher fell too far behind and was ended; watch again")
                if got[0].service != request.name:
                    continue
                while entry.items:  # a burst of changes: read the service once for all of them
                    entry.items.popleft()
                await asyncio.sleep(0)
                views = await self.service.read_snapshot(
                    read_service_views, names=[request.name], tenant=tenant_scope()
                )
                if not views:
                    return  # deleted
                now = endpoints_of(views[0])
                if [(e.replica, e.address) for e in now] != [(e.replica, e.address) for e in last]:
                    last = now
                    yield service_pb2.Endpoints(service=request.name, endpoints=now, at=time.time())
        finally:
            self.service.fanout.unsubscribe(entry)
            left = self.controller.watches[caller] - 1
            if left:
                self.controller.watches[caller] = left
            else:
                del self.controller.watches[caller]
