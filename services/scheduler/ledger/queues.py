"""Queue rows: the quota specs the view holds, their upsert and delete."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import Queue
from phalanx.core.quota import FlavorQuota, QueueSpec

from ._sql import _changed_queues


def queue_spec(row: Any) -> QueueSpec:
    quotas = {}
    for flavor, q in (row["quotas"] or {}).items():
        quotas[flavor] = FlavorQuota(
            gpus=float(q.get("gpus", 0)),
            mig_slices=int(q.get("mig_slices", 0)),
            borrow_limit=None if q.get("borrow_limit") is None else float(q["borrow_limit"]),
        )
    return QueueSpec(
        row["name"],
        quotas,
        cohort=row["cohort"] or "",
        weight=float(row["weight"] or 1.0),
        tenants=frozenset(row["tenants"] or ()),
        max_priority=int(row.get("max_priority") or 0),
    )


def load_queues(conn: Connection) -> dict[str, QueueSpec]:
    return {r["name"]: queue_spec(r) for r in conn.execute(select(*Queue.__table__.c)).mappings()}


def upsert_queue(conn: Connection, spec: QueueSpec, now: float) -> None:
    values = dict(
        cohort=spec.cohort,
        weight=spec.weight,
        tenants=sorted(spec.tenants),
        max_priority=spec.max_priority,
        updated_at=now,
        quotas={
            f: {"gpus": q.gpus, "mig_slices": q.mig_slices, "borrow_limit": q.borrow_limit}
            for f, q in spec.quotas.items()
        },
    )
    _changed_queues(conn)
    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(
        dialect_insert(Queue)
        .values(name=spec.name, **values)
        .on_conflict_do_update(index_elements=["name"], set_=values)
    )


def delete_queue(conn: Connection, name: str) -> None:
    _changed_queues(conn)
    conn.execute(delete(Queue).where(Queue.name == name))
