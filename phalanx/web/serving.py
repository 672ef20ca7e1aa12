"""The dashboard's services view: serving fleets (ServiceService) as JSON for the page, and the replica each job is.

The scheduler's ServiceService is called directly, on the channel of the visitor's Client (its token, TLS and retry
policy), so a user sees its tenant's services only, as through the CLI. Each service is shown with its revision,
ready and desired replicas, the controller's message and the autoscaler's last decision; each replica with its
index, revision, state, readiness, nodes, leader address and job. A job that is a replica carries its service,
index, revision and readiness in the jobs list (`replica_index`, joined by job id).
"""

from __future__ import annotations

from typing import Any

import grpc

from phalanx.api.v1 import service_pb2, service_pb2_grpc
from phalanx.client import (
    Client,
    NotFoundError,
    PermissionDeniedError,
    RPCError,
    UnauthenticatedError,
)

LIST_TIMEOUT_S = 10.0  # as the dashboard's other scheduler calls (its Client's timeout)


def replica_view(r: service_pb2.ServiceReplica) -> dict[str, Any]:
    return {
        "index": r.index,
        "revision": r.revision,
        "state": r.state,
        "ready": r.ready,
        "nodes": list(r.nodes),
        "leader": r.leader_address,
        "job_id": r.job_id,
        "message": r.message,
        "surge": r.surge,
    }


def autoscale_view(a: service_pb2.Autoscale) -> dict[str, Any] | None:
    """The autoscaler's bounds and target (None: the service has none)."""
    if a.max_replicas <= 0:
        return None
    return {"min": a.min_replicas, "max": a.max_replicas, "metric": a.metric, "target": a.target}


def service_view(s: service_pb2.Service) -> dict[str, Any]:
    template = s.spec.template
    return {
        "name": s.spec.name,
        "tenant": s.tenant,
        "revision": s.revision,
        "desired": s.spec.replicas,
        "ready": s.ready_replicas,
        "message": s.message,
        "autoscaler": s.autoscaler,  # the last decision, in words ("" none yet)
        "autoscale": autoscale_view(s.spec.autoscale),
        "gang": f"{template.replicas}x{template.gpus_per_replica}",  # one replica: nodes x GPUs per node
        "created_at": s.created_at,
        "replicas": [replica_view(r) for r in s.replicas],
    }


def replica_index(services: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Job id -> what that job is in its service: {service, replica, revision, ready, state}. A job is at most one
    replica (the controller makes a gang per replica), so the last entry seen stands."""
    out: dict[str, dict[str, Any]] = {}
    for s in services:
        for r in s["replicas"]:
            if r["job_id"]:
                out[r["job_id"]] = {
                    "service": s["name"],
                    "replica": r["index"],
                    "revision": r["revision"],
                    "ready": r["ready"],
                    "state": r["state"],
                }
    return out


def with_services(jobs: list[dict[str, Any]], index: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs, each replica's with its `service` entry from `index` (the others as they are: `service` None)."""
    return [dict(j, service=index[j["id"]]) if j["id"] in index else j for j in jobs]


def _error(exc: grpc.RpcError) -> RPCError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else "") or str(code.name).lower().replace("_", " ")
    for kind in (UnauthenticatedError, PermissionDeniedError, NotFoundError):
        if code == kind.default_code:
            return kind(message)
    return RPCError(message, code)


def list_services(client: Client) -> list[dict[str, Any]] | None:
    """The services the client's token may see, as the page draws them; None when the scheduler has no
    ServiceService (one older than serving fleets). Other failures raise the SDK's errors (UnauthenticatedError,
    PermissionDeniedError, RPCError) as the Client's own calls do."""
    # The SDK's service methods are not used here: the stub rides on the Client's channel, which carries the
    # visitor's token and the Client's retry policy, like every other call of the dashboard.
    stub = service_pb2_grpc.ServiceServiceStub(client._channel)  # type: ignore[no-untyped-call]  # generated
    try:
        got = stub.ListServices(service_pb2.ListServicesRequest(), timeout=LIST_TIMEOUT_S)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise _error(exc) from exc
    return sorted((service_view(s) for s in got.services), key=lambda s: (s["tenant"], s["name"]))
