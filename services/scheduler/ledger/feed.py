"""The change feed: the generation a commit makes, the rows it changed (ledger_changes) and the notice replicas wake on."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, text, update

from db.models import LedgerClock

from ._sql import Changes

NOTIFY_CHANNEL = "phalanx_events"


def bump_generation(conn: Connection, generation: int, notice: dict[str, Any] | None = None) -> int:
    """Set the next generation (the caller holds the clock row, so it knows the current one); on PostgreSQL the
    same statement queues the NOTIFY that wakes other replicas (delivered at commit, never on rollback)."""
    if conn.dialect.name == "postgresql" and notice is not None:
        body = json.dumps(notice, separators=(",", ":"))
        if len(body) > 7000:
            body = json.dumps({"replica": notice.get("replica"), "all": True})
        conn.exec_driver_sql(
            "UPDATE ledger_clock SET generation = %s WHERE id = 1 AND pg_notify(%s, %s) IS NOT NULL",
            (generation + 1, NOTIFY_CHANNEL, body),
        )
    else:
        conn.execute(update(LedgerClock).where(LedgerClock.id == 1).values(generation=generation + 1))
    return generation + 1


def announce(conn: Connection, replica: str) -> None:
    """Tell the other replicas this one is here (PostgreSQL: a notice at commit, nothing written). A follower says so
    at each lease tick, so that the leader knows it is not the ledger's one writer (SchedulerService._fence_ahead)."""
    if conn.dialect.name == "postgresql":
        body = json.dumps({"replica": replica, "here": True}, separators=(",", ":"))
        conn.exec_driver_sql("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, body))


CHANGES_KEPT_S = 600.0  # ledger_changes rows older than this are deleted: a replica further behind reloads whole


def record_changes(conn: Connection, generation: int, replica: str, changes: Changes, now: float) -> None:
    """Store what the transaction that made `generation` changed (the caller holds the clock row)."""
    conn.execute(
        text("INSERT INTO ledger_changes (generation, replica, at, body) VALUES (:g, :r, :at, :body)"),
        dict(g=generation, r=replica, at=now, body=changes.to_json()),
    )


def read_changes(conn: Connection, after: int, upto: int) -> Changes | None:
    """What the transactions that made generations after+1 .. upto changed, merged; None when a row is missing
    (pruned, or written by a version that did not record changes): the caller reloads its whole view."""
    if upto - after > 100_000:
        return None
    rows = conn.execute(
        text("SELECT generation, body FROM ledger_changes WHERE generation > :a AND generation <= :u"),
        dict(a=after, u=upto),
    ).all()
    if len(rows) != upto - after:
        return None
    merged = Changes()
    for _, body in sorted(rows):
        merged.merge_json(body)
    return merged


def prune_changes(conn: Connection, before: float) -> None:
    conn.execute(text("DELETE FROM ledger_changes WHERE at < :t"), dict(t=before))
