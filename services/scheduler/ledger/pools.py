"""Spare pool rows (phalanx.core.pools): the pools the view holds, their creation, deletion and booking."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, delete, insert, select, update

from db.models import SparePool as PoolRow
from phalanx.core.pools import SparePool

from ._sql import _changed_queues


def load_pools(conn: Connection) -> dict[str, SparePool]:
    rows = conn.execute(select(PoolRow.name, PoolRow.tier, PoolRow.per_domain, PoolRow.booked, PoolRow.created_at))
    return {
        r.name: SparePool(
            r.name,
            r.tier,
            int(r.per_domain),
            float(r.created_at),
            {str(d): [str(n) for n in nodes] for d, nodes in (r.booked or {}).items()},
        )
        for r in rows
    }


# A pool's rows change what the other replicas' views hold as their queues do: they reload both (viewsync).
def insert_pool(conn: Connection, pool: SparePool, now: float) -> None:
    _changed_queues(conn)
    conn.execute(
        insert(PoolRow).values(
            name=pool.name,
            tier=pool.tier,
            per_domain=pool.per_domain,
            booked=pool.booked,
            created_at=now,
            updated_at=now,
        )
    )


def delete_pool(conn: Connection, name: str) -> None:
    _changed_queues(conn)
    conn.execute(delete(PoolRow).where(PoolRow.name == name))


def set_pool_booking(conn: Connection, name: str, booked: Mapping[str, Sequence[str]], now: float) -> None:
    _changed_queues(conn)
    conn.execute(
        update(PoolRow)
        .where(PoolRow.name == name)
        .values(booked={d: list(n) for d, n in booked.items()}, updated_at=now)
    )
