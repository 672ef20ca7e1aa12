"""The serving-fleet calls of :class:`phalanx.client.Client` (the ServiceService API), kept apart from the job calls
of ``_client.py``: create, apply, get, list, update, scale, roll back and delete services, push autoscaler metrics,
and stream a service's endpoints."""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from typing import Any

import grpc

from phalanx.api.v1 import service_pb2, service_pb2_grpc

from ._channel import backoff_delay
from ._errors import from_grpc_error
from ._service_types import Endpoint, Service, ServiceSpec
from ._spec_file import parse_service_spec

__all__ = ["ServiceCalls", "service_stub", "as_spec", "update_request", "push_metric_request"]

SpecLike = ServiceSpec | Mapping[str, Any]


def service_stub(channel: grpc.Channel | grpc.aio.Channel) -> service_pb2_grpc.ServiceServiceStub:
    """The generated ServiceService stub over a blocking or an asyncio channel."""
    return service_pb2_grpc.ServiceServiceStub(channel)  # type: ignore[no-untyped-call]  # generated, unannotated


def as_spec(spec: SpecLike) -> ServiceSpec:
    """A :class:`ServiceSpec` as given, or one from a spec document (checked against the schema first)."""
    return spec if isinstance(spec, ServiceSpec) else parse_service_spec(spec)


def update_request(
    name: str, spec: SpecLike, max_unavailable: int | None, max_surge: int | None
) -> service_pb2.UpdateServiceRequest:
    """The UpdateServiceRequest of :meth:`ServiceCalls.update_service` (Client and AsyncClient)."""
    given = as_spec(spec)
    request = service_pb2.UpdateServiceRequest(name=name, template=given.template())
    request.template.name = name
    unavailable = given.max_unavailable if max_unavailable is None else max_unavailable
    surge = given.max_surge if max_surge is None else max_surge
    if unavailable is not None:
        request.max_unavailable = int(unavailable)
    if surge is not None:
        request.max_surge = int(surge)
    return request


def push_metric_request(name: str, metric: str, value: float, replica: int | None) -> service_pb2.PushMetricRequest:
    return service_pb2.PushMetricRequest(
        service=name, metric=metric, value=float(value), replica=-1 if replica is None else int(replica)
    )


def endpoints_of(event: service_pb2.Endpoints) -> list[Endpoint]:
    return [Endpoint.from_proto(e) for e in event.endpoints]


class ServiceCalls:
    """The ServiceService calls, mixed into :class:`phalanx.client.Client` (which provides the channel, the target,
    the deadline and the retries)."""

    target: str
    timeout: float
    retries: int
    _service_stub: service_pb2_grpc.ServiceServiceStub

    def _service_call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._service_stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, self.target) from exc

    def create_service(self, spec: ServiceSpec | Mapping[str, Any]) -> Service:
        """Create a service: ``spec.replicas`` replicas, each a gang of ``nodes_per_replica`` x ``gpus_per_node``
        GPUs, kept running by the scheduler's service controller.

        Example:
            >>> spec = ServiceSpec("llm", replicas=2, nodes_per_replica=2, gpus_per_node=8,
            ...                    command=["vllm", "serve", "meta-llama/Llama-3.1-70B"], port=8000,
            ...                    ready_probe=ReadyProbe(http_port=8000, http_path="/health"))
            >>> service = client.create_service(spec)

        Args:
            spec: The spec, or a spec document (a spec file's mapping, checked against the schema first).

        Returns:
            The service as created (revision 1; its replicas follow as they are placed).

        Raises:
            ServiceSpecError: A document that does not match the schema (nothing was sent).
            InvalidArgumentError: A bad spec, e.g. a replica no domain of the cluster could ever hold.
            RPCError: ALREADY_EXISTS: a service of that name exists (use :meth:`apply_service` or
                :meth:`update_service`).
            PermissionDeniedError: A queue or priority the caller may not use.
        """
        request = service_pb2.CreateServiceRequest(spec=as_spec(spec).to_proto())
        return Service.from_proto(self._service_call("CreateService", request))

    def apply_service(self, spec: ServiceSpec | Mapping[str, Any]) -> Service:
        """Create the service, or bring it to this spec: a new revision (rolled out replica by replica) when its
        replica template differs, new settings (replicas, rollout bounds, autoscaler) otherwise; nothing when it is
        the same. What ``phalanx apply -f`` calls.

        Args:
            spec: The spec, or a spec document (checked against the schema first).

        Returns:
            The service.

        Raises:
            ServiceSpecError: A document that does not match the schema (nothing was sent).
            InvalidArgumentError: A bad spec (nothing changed).
        """
        request = service_pb2.ApplyServiceRequest(spec=as_spec(spec).to_proto())
        return Service.from_proto(self._service_call("ApplyService", request))

    def get_service(self, name: str) -> Service:
        """One service, with its replicas and every revision (newest first).

        Raises:
            NotFoundError: No such service (or another tenant's).
        """
        return Service.from_proto(self._service_call("GetService", service_pb2.GetServiceRequest(name=name)))

    def list_services(self) -> list[Service]:
        """Every service (of the caller's tenant, or all for an admin), with its replicas (no revisions)."""
        response = self._service_call("ListServices", service_pb2.ListServicesRequest())
        return [Service.from_proto(s) for s in response.services]

    def update_service(
        self,
        name: str,
        spec: ServiceSpec | Mapping[str, Any],
        *,
        max_unavailable: int | None = None,
        max_surge: int | None = None,
    ) -> Service:
        """A new revision: the replica template of ``spec`` (command, env, roles, probe, nodes and GPUs, priority,
        queue, tiers, host resources, restart) replaces the current one, and the replicas are rolled to it
        replica by replica, at most ``max_unavailable`` below and ``max_surge`` above the replica count at once.
        The spec's name, replica count, spread tier, port and autoscaler are not changed by an update (see
        :meth:`apply_service`).

        Example:
            >>> service = client.get_service("llm")
            >>> client.update_service("llm", dataclasses.replace(service.spec, command=["vllm", "serve", "v2"]))

        Args:
            name: The service.
            spec: Its new template (e.g. ``service.spec`` with changes), or a spec document.
            max_unavailable: New rollout bound (None: the spec's, else unchanged).
            max_surge: New rollout bound (None: the spec's, else unchanged).

        Returns:
            The service, at its new revision (unchanged when the template is the same).

        Raises:
            NotFoundError: No such service.
            InvalidArgumentError: A bad template or bounds (nothing changed).
        """
        request = update_request(name, spec, max_unavailable, max_surge)
        return Service.from_proto(self._service_call("UpdateService", request))

    def scale_service(self, name: str, replicas: int) -> Service:
        """Set the replica count (0 stops every replica and keeps the service).

        Raises:
            NotFoundError: No such service.
            FailedPreconditionError: An autoscaled service, and a count outside its autoscaler's bounds.
        """
        request = service_pb2.ScaleServiceRequest(name=name, replicas=int(replicas))
        return Service.from_proto(self._service_call("ScaleService", request))

    def rollback_service(self, name: str, revision: int = 0) -> Service:
        """Roll back to an earlier revision's template, as a new revision (rolled out like an update).

        Args:
            name: The service.
            revision: The revision to go back to; 0: the one before the current one.

        Raises:
            NotFoundError: No such service, or no such revision.
            FailedPreconditionError: It runs that revision already, or has no earlier one.
        """
        request = service_pb2.RollbackServiceRequest(name=name, revision=int(revision))
        return Service.from_proto(self._service_call("RollbackService", request))

    def delete_service(self, name: str) -> Service:
        """Stop every replica and remove the service (its revisions stay in the ledger).

        Returns:
            The service as deleted (``deleted`` true).

        Raises:
            NotFoundError: No such service.
        """
        return Service.from_proto(self._service_call("DeleteService", service_pb2.DeleteServiceRequest(name=name)))

    def push_metric(self, name: str, metric: str, value: float, *, replica: int | None = None) -> None:
        """Give the autoscaler a metric value instead of its scraping one (kept a minute).

        Args:
            name: The service.
            metric: The metric's name (its autoscaler's ``metric``).
            value: The value.
            replica: The replica it was measured on; None: the service as a whole (the value is then its total,
                divided among the ready replicas).

        Raises:
            NotFoundError: No such service.
            InvalidArgumentError: A bad name or value.
        """
        self._service_call("PushMetric", push_metric_request(name, metric, value, replica))

    def watch_endpoints(self, name: str, *, timeout: float | None = None) -> Generator[list[Endpoint], None, None]:
        """Stream a service's endpoints: the ready replicas' leader addresses now, then after every change.

        A stream that breaks with UNAVAILABLE after it has delivered (a scheduler restart) is re-opened unless
        ``retries`` is 0; a list equal to the last one is not repeated. The stream ends when the service is
        deleted. Closing the iterator hangs up.

        Example:
            >>> for endpoints in client.watch_endpoints("llm"):
            ...     balancer.set_backends([e.address for e in endpoints])

        Args:
            name: The service.
            timeout: Give up after this many seconds (DeadlineExceededError); None: never.

        Yields:
            The ready replicas' :class:`Endpoint` objects, by replica index (possibly empty).

        Raises:
            NotFoundError: No such service.
            DeadlineExceededError: ``timeout`` passed.
        """
        request = service_pb2.WatchEndpointsRequest(name=name)
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        last: list[Endpoint] | None = None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._service_stub.WatchEndpoints(request, timeout=remaining)
            delivered = False
            try:
                for event in call:
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
                        time.sleep(delay)
                        continue
                raise from_grpc_error(exc, self.target) from exc
            finally:
                call.cancel()
