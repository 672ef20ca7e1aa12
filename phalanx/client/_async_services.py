"""The serving-fleet calls of :class:`phalanx.client.AsyncClient`: the same as :class:`phalanx.client.Client`'s
(``_services.py``), with coroutines and an async endpoints stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import grpc

from phalanx.api.v1 import service_pb2, service_pb2_grpc

from ._channel import backoff_delay
from ._errors import from_grpc_error
from ._service_types import Endpoint, Service, ServiceSpec
from ._services import as_spec, endpoints_of, push_metric_request, service_stub, update_request

__all__ = ["AsyncServiceCalls"]


class AsyncServiceCalls:
    """The ServiceService calls, mixed into :class:`phalanx.client.AsyncClient` (which provides the channel)."""

    target: str
    timeout: float
    retries: int
    _service_stub_of: tuple[grpc.aio.Channel, service_pb2_grpc.ServiceServiceStub] | None = None

    # Provided by AsyncClient: its channel, opened on first use (declared here, defined there)
    _aio_channel: Callable[[], grpc.aio.Channel]

    def _services(self) -> service_pb2_grpc.ServiceServiceStub:
        channel = self._aio_channel()
        cached = self._service_stub_of
        if cached is None or cached[0] is not channel:
            cached = (channel, service_stub(channel))
            self._service_stub_of = cached
        return cached[1]

    async def _service_call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._services(), method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, self.target) from exc

    async def create_service(self, spec: ServiceSpec | Mapping[str, Any]) -> Service:
        """Create a service (see :meth:`Client.create_service`)."""
        request = service_pb2.CreateServiceRequest(spec=as_spec(spec).to_proto())
        return Service.from_proto(await self._service_call("CreateService", request))

    async def apply_service(self, spec: ServiceSpec | Mapping[str, Any]) -> Service:
        """Create the service or bring it to this spec (see :meth:`Client.apply_service`)."""
        request = service_pb2.ApplyServiceRequest(spec=as_spec(spec).to_proto())
        return Service.from_proto(await self._service_call("ApplyService", request))

    async def get_service(self, name: str) -> Service:
        """One service, with its replicas and revisions (see :meth:`Client.get_service`)."""
        return Service.from_proto(await self._service_call("GetService", service_pb2.GetServiceRequest(name=name)))

    async def list_services(self) -> list[Service]:
        """Every service (see :meth:`Client.list_services`)."""
        response = await self._service_call("ListServices", service_pb2.ListServicesRequest())
        return [Service.from_proto(s) for s in response.services]

    async def update_service(
        self,
        name: str,
        spec: ServiceSpec | Mapping[str, Any],
        *,
        max_unavailable: int | None = None,
        max_surge: int | None = None,
    ) -> Service:
        """A new revision with the template of ``spec`` (see :meth:`Client.update_service`)."""
        request = update_request(name, spec, max_unavailable, max_surge)
        return Service.from_proto(await self._service_call("UpdateService", request))

    async def scale_service(self, name: str, replicas: int) -> Service:
        """Set the replica count (see :meth:`Client.scale_service`)."""
        request = service_pb2.ScaleServiceRequest(name=name, replicas=int(replicas))
        return Service.from_proto(await self._service_call("ScaleService", request))

    async def rollback_service(self, name: str, revision: int = 0) -> Service:
        """Roll back to an earlier revision (see :meth:`Client.rollback_service`)."""
        request = service_pb2.RollbackServiceRequest(name=name, revision=int(revision))
        return Service.from_proto(await self._service_call("RollbackService", request))

    async def delete_service(self, name: str) -> Service:
        """Stop every replica and remove the service (see :meth:`Client.delete_service`)."""
        request = service_pb2.DeleteServiceRequest(name=name)
        return Service.from_proto(await self._service_call("DeleteService", request))

    async def push_metric(self, name: str, metric: str, value: float, *, replica: int | None = None) -> None:
        """Give the autoscaler a metric value (see :meth:`Client.push_metric`)."""
        await self._service_call("PushMetric", push_metric_request(name, metric, value, replica))

    async def watch_endpoints(self, name: str, *, timeout: float | None = None) -> AsyncGenerator[list[Endpoint], None]:
        """Stream a service's endpoints: now, then after every change (see :meth:`Client.watch_endpoints`)."""
        request = service_pb2.WatchEndpointsRequest(name=name)
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        last: list[Endpoint] | None = None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._services().WatchEndpoints(request, timeout=remaining)
            delivered = False
            try:
                async for event in call:
                    delivered = True
                    endpoints = endpoints_of(event)
                    if endpoints != last:
                        last = endpoints
                        yield endpoints
                return
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE and delivered and self.retries:
                    delay = backoff_delay(0)
                    if deadline is None or time.monotonic() + delay < deadline:
                        await asyncio.sleep(delay)
                        continue
                raise from_grpc_error(exc, self.target) from exc
            finally:
                call.cancel()
