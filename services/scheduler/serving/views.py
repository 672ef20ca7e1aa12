"""Services as the API shows them, read from the ledger (a reader's snapshot, never the cycle's view): each with
its replicas (their jobs' state, readiness, nodes and leader address), and its endpoints."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from db.models import Job, Node
from phalanx.api.v1 import service_pb2

from .. import ledger
from .commands import service_spec_of, template_of


def replica_state(row: Any, *, down: bool = False) -> str:
    if down:
        return "FAILED"
    if row["state"] == "PENDING":
        return "RESTARTING" if row["attempt"] else "PENDING"
    if row["state"] == "RUNNING":
        if row.get("preempted_by"):
            return "TERMINATING"
        return "READY" if row.get("ready") else "STARTING"
    return str(row["state"])


def endpoint_port(spec: service_pb2.ServiceSpec) -> int:
    """The leader's port its endpoints name: the service's port, else its ready probe's HTTP port (0: none)."""
    return spec.port or (spec.template.ready_probe.http_port if spec.template.HasField("ready_probe") else 0)


def leader_host(replica: service_pb2.ServiceReplica, spec: service_pb2.ServiceSpec) -> str:
    """The host of a replica's leader: its endpoint address without the port the endpoints add."""
    return replica.leader_address.rsplit(":", 1)[0] if endpoint_port(spec) else replica.leader_address


def read_service_views(
    conn: Connection,
    *,
    names: list[str] | None = None,
    tenant: str | None = None,
    deleted: bool = False,
    revisions: bool = False,
) -> list[service_pb2.Service]:
    rows = [
        r for r in ledger.read_services(conn, names=names, deleted=deleted) if tenant is None or r["tenant"] == tenant
    ]
    if not rows:
        return []
    wanted = [r["name"] for r in rows]
    ids = [
        r[0]
        for r in conn.execute(
            select(Job.id).where(Job.service.in_(wanted), Job.state.in_(("PENDING", "RUNNING", "FAILED")))
        )
    ]
    jobs = ledger.read_jobs(conn, job_ids=ids) if ids else []
    addresses = {name: address for name, address in conn.execute(select(Node.name, Node.address))}
    by_service: dict[str, list[tuple[Any, list[tuple[int, str, list[int]]]]]] = {}
    for row, allocations, _ in jobs:
        by_service.setdefault(row["service"], []).append((row, allocations))
    out = []
    for row in rows:
        out.append(_service(conn, row, by_service.get(row["name"], []), addresses, revisions))
    return out


def _service(
    conn: Connection,
    row: dict[str, Any],
    jobs: list[tuple[Any, list[tuple[int, str, list[int]]]]],
    addresses: dict[str, str],
    revisions: bool,
) -> service_pb2.Service:
    spec = service_spec_of(row)
    msg = service_pb2.Service(
        spec=spec,
        revision=row["revision"],
        message=row["message"] or "",
        tenant=row["tenant"] or "",
        created_at=row["created_at"],
        deleted=row["deleted_at"] is not None,
        autoscaler=row["autoscaler"] or "",
    )
    port = endpoint_port(spec)
    restart_never = spec.template.restart == "never"
    replicas = []
    for job, allocations in jobs:
        serving = job["serving"] or {}
        index, revision = int(serving.get("replica", 0)), int(serving.get("revision", 0))
        down = job["state"] == "FAILED"
        if down and (not restart_never or revision != row["revision"]):
            continue  # a failed replica of an old revision, or one that restarted since: history, not the fleet
        nodes = list(dict.fromkeys(node for _, node, _ in sorted(allocations)))
        leader = ""
        if nodes and job["state"] == "RUNNING":
            host = addresses.get(nodes[0]) or nodes[0]
            leader = f"{host}:{port}" if port else host
        replicas.append(
            service_pb2.ServiceReplica(
                index=index,
                revision=revision,
                state=replica_state(job, down=down),
                ready=bool(job["ready"]) and job["state"] == "RUNNING",
                nodes=nodes,
                leader_address=leader,
                job_id=job["id"],
                message=job["message"] or "",
                surge=bool(serving.get("surge")),
            )
        )
    replicas.sort(key=lambda r: (r.index, r.revision))
    msg.replicas.extend(replicas)
    msg.ready_replicas = sum(1 for r in replicas if r.ready)
    if revisions:
        for rev in ledger.read_revisions(conn, row["name"]):
            msg.revisions.add(
                revision=rev["revision"],
                template=template_of(rev["template"] or {}),
                created_at=rev["created_at"],
                cause=rev["cause"] or "",
            )
    return msg


def endpoints_of(service: service_pb2.Service) -> list[service_pb2.Endpoint]:
    return [
        service_pb2.Endpoint(replica=r.index, address=r.leader_address, revision=r.revision)
        for r in service.replicas
        if r.ready and r.leader_address
    ]
