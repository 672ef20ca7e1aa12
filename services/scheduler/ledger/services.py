"""Service rows (serving fleets): a service's desired state and its revisions, and its replica jobs that ended
for good. The replicas themselves are job rows (`jobs.service`), written with the cycle's job writes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from db.models import Job, Service, ServiceRevision


def read_services(conn: Connection, *, names: list[str] | None = None, deleted: bool = False) -> list[dict[str, Any]]:
    """Service rows by name (deleted ones only when asked), each with its current revision's template."""
    q = select(*Service.__table__.c, ServiceRevision.template).join(
        ServiceRevision,
        (ServiceRevision.service == Service.name) & (ServiceRevision.revision == Service.revision),
    )
    if names is not None:
        q = q.where(Service.name.in_(names))
    if not deleted:
        q = q.where(Service.deleted_at.is_(None))
    return [dict(r) for r in conn.execute(q.order_by(Service.name)).mappings()]


def read_revisions(conn: Connection, name: str) -> list[dict[str, Any]]:
    q = select(*ServiceRevision.__table__.c).where(ServiceRevision.service == name)
    return [dict(r) for r in conn.execute(q.order_by(ServiceRevision.revision.desc())).mappings()]


def insert_service(
    conn: Connection,
    name: str,
    tenant: str,
    replicas: int,
    spec: dict[str, Any],
    template: dict[str, Any],
    now: float,
) -> None:
    """A new service at revision 1. A deleted service of that name is replaced (its revisions go with it)."""
    conn.execute(delete(Service).where(Service.name == name, Service.deleted_at.is_not(None)))
    conn.execute(delete(ServiceRevision).where(ServiceRevision.service == name))
    conn.execute(
        insert(Service).values(
            name=name,
            tenant=tenant,
            revision=1,
            replicas=replicas,
            spec=spec,
            message="created",
            autoscaler="",
            created_at=now,
            updated_at=now,
            deleted_at=None,
            version=0,
        )
    )
    conn.execute(
        insert(ServiceRevision).values(service=name, revision=1, template=template, created_at=now, cause="create")
    )


def add_revision(conn: Connection, name: str, revision: int, template: dict[str, Any], cause: str, now: float) -> None:
    conn.execute(
        insert(ServiceRevision).values(service=name, revision=revision, template=template, created_at=now, cause=cause)
    )
    conn.execute(
        update(Service)
        .where(Service.name == name)
        .values(revision=revision, updated_at=now, version=Service.version + 1)
    )


def update_service(conn: Connection, name: str, now: float, **changes: Any) -> None:
    conn.execute(
        update(Service).where(Service.name == name).values(updated_at=now, version=Service.version + 1, **changes)
    )


def failed_replicas(conn: Connection, names: list[str]) -> dict[str, list[tuple[int, int, str]]]:
    """Each service's replica jobs that ended FAILED (restart never leaves them down): (index, revision, job id)."""
    if not names:
        return {}
    rows = conn.execute(
        select(Job.id, Job.service, Job.serving).where(Job.service.in_(names), Job.state == "FAILED")
    ).mappings()
    out: dict[str, list[tuple[int, int, str]]] = {}
    for r in rows:
        serving = r["serving"] or {}
        out.setdefault(r["service"], []).append(
            (int(serving.get("replica", 0)), int(serving.get("revision", 0)), r["id"])
        )
    return out
