"""What every writer of the ledger shares: the transaction's record of what it changed, bulk inserts, chunks.

This module imports nothing else of the ledger package, so every aggregate module can import it without a cycle."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from psycopg import pq
from sqlalchemy import Connection, insert

T = TypeVar("T")
CHANGES = "phalanx_changes"  # Connection.info key of the transaction's Changes (see track_changes)


class Changes:
    """What one scheduling transaction changed in the rows the replicas' views hold, recorded by the ledger's writes
    and stored with the generation it made (ledger_changes), so another replica reloads only these rows.

    `jobs`: job ids whose job, allocation or rank rows changed; `nodes`, `gpus`: ids of node and GPU rows changed
    in what a view holds (state, health, topology, MIG); `beats`, `acks`, `revisions`: node id -> the new value of
    a monotonic column (applied as it is, no reload); `queues`: a queue changed; `assigned`: nodes given
    assignments (their streams wake)."""

    __slots__ = ("acks", "assigned", "beats", "gpus", "jobs", "nodes", "queues", "revisions", "sched")

    def __init__(self) -> None:
        self.jobs: set[str] = set()
        self.nodes: set[int] = set()
        self.gpus: set[int] = set()
        self.beats: dict[int, float] = {}
        self.acks: dict[int, int] = {}
        self.revisions: dict[int, int] = {}
        self.queues = False
        self.assigned: set[str] = set()
        # Whether a write changed what a scheduling pass decides on (a job's state, allocations, a node, a GPU, a
        # queue); rank reports, heartbeats and acks do not: a cycle without such a write need not pass again.
        self.sched = False

    @property
    def any(self) -> bool:
        return bool(self.jobs or self.nodes or self.gpus or self.beats or self.acks or self.revisions or self.queues)

    def to_json(self) -> str:
        return json.dumps(
            {
                "jobs": sorted(self.jobs),
                "nodes": sorted(self.nodes),
                "gpus": sorted(self.gpus),
                "beats": self.beats,
                "acks": self.acks,
                "revisions": self.revisions,
                "queues": self.queues,
                "assigned": sorted(self.assigned),
                "sched": self.sched,
            },
            separators=(",", ":"),
        )

    def merge_json(self, body: str) -> None:
        d = json.loads(body)
        self.jobs.update(d["jobs"])
        self.nodes.update(d["nodes"])
        self.gpus.update(d["gpus"])
        for mine, theirs in ((self.beats, d["beats"]), (self.acks, d["acks"]), (self.revisions, d["revisions"])):
            for key, value in theirs.items():
                if value > mine.get(int(key), value - 1):
                    mine[int(key)] = value
        self.queues = self.queues or d["queues"]
        self.assigned.update(d["assigned"])
        self.sched = self.sched or d["sched"]


def track_changes(conn: Connection) -> Changes:
    """Record what this transaction writes to the view's rows (until untrack_changes)."""
    changes = conn.info[CHANGES] = Changes()
    return changes


def untrack_changes(conn: Connection) -> None:
    conn.info.pop(CHANGES, None)


def _changed_jobs(conn: Connection, *job_ids: str, sched: bool = True) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.jobs.update(job_ids)
        changes.sched = changes.sched or sched


def _changed_nodes(conn: Connection, *node_ids: int) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.nodes.update(node_ids)
        changes.sched = True


def _changed_queues(conn: Connection) -> None:
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.queues = changes.sched = True


def _raised(conn: Connection, column: str, values: dict[int, Any]) -> None:
    changes = conn.info.get(CHANGES)
    if changes is None:
        return
    mine = {"last_heartbeat": changes.beats, "acked_revision": changes.acks, "revision": changes.revisions}[column]
    for key, value in values.items():
        if value > mine.get(key, value - 1):
            mine[key] = value


def in_pipeline(conn: Connection) -> bool:
    """Whether statements on `conn` are sent without waiting for their answers now (inside `pipelined`)."""
    if conn.dialect.name != "postgresql":
        return False
    driver = conn.connection.driver_connection
    return driver is not None and driver.pgconn.pipeline_status != pq.PipelineStatus.OFF


@contextlib.contextmanager
def pipelined(conn: Connection, enabled: bool = True):
    """On PostgreSQL, send the statements issued inside without waiting for each reply (psycopg pipeline mode):
    a cycle's closing writes need no results, so they cost one round trip instead of one each."""
    if conn.dialect.name != "postgresql" or not enabled:
        yield
        return
    driver = conn.connection.driver_connection  # psycopg's Connection (None only once the pool closed it)
    if driver is None:
        raise RuntimeError("pipelined: the connection has no live driver connection")
    with driver.pipeline():
        yield


_RECORDSET_SQL: dict[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]] = {}


def insert_rows(conn: Connection, table, rows: list[dict[str, Any]]) -> None:
    """Insert many rows in one statement.

    On PostgreSQL the rows travel as one JSON document, expanded by `json_to_recordset`: one round trip and one
    cached statement whatever the gang size, and the encoding runs in C (psycopg's `executemany` sends a statement
    per row, and adapting per-column arrays costs more than the insert). SQLite's executemany runs in C already.
    """
    if not rows:
        return
    if conn.dialect.name != "postgresql":
        conn.execute(insert(table), rows)
        return
    tbl = table.__table__
    names = tuple(rows[0])
    key = (tbl.name, names)
    cached = _RECORDSET_SQL.get(key)
    if cached is None:
        types = [tbl.c[n].type.compile(dialect=conn.dialect) for n in names]
        binary = tuple(n for n, t in zip(names, types, strict=True) if t.upper() == "BYTEA")
        cols = ", ".join(f'"{n}"' for n in names)
        select_list = ", ".join(f"decode(\"{n}\", 'base64')" if n in binary else f'"{n}"' for n in names)
        record = ", ".join(f'"{n}" {"text" if n in binary else t}' for n, t in zip(names, types, strict=True))
        sql = f'INSERT INTO "{tbl.name}" ({cols}) SELECT {select_list} FROM json_to_recordset(%s::json) AS t({record})'
        cached = _RECORDSET_SQL[key] = (sql, binary)
    sql, binary = cached
    if binary:
        rows = [{**r, **{n: base64.b64encode(r[n]).decode() for n in binary}} for r in rows]
    conn.exec_driver_sql(sql, (json.dumps(rows, separators=(",", ":")),))


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _json_list(value: Any) -> list[Any]:
    if isinstance(value, str):  # a JSON column read back as text by some drivers
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return list(value) if isinstance(value, list) else []
