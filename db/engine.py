"""Engine set-up for the two supported stores: SQLite (embedded default) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url


def normalize_url(url: str) -> str:
    """Map `postgresql://` and `postgres://` to the psycopg 3 driver; leave everything else alone."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def is_sqlite(engine_or_url: Engine | str) -> bool:
    url = engine_or_url.url if isinstance(engine_or_url, Engine) else make_url(normalize_url(engine_or_url))
    return url.get_backend_name() == "sqlite"


def make_engine(url: str, *, pool_size: int = 8, idle_in_transaction_timeout_s: float | None = None) -> Engine:
    """Create an engine. SQLite gets WAL, a busy timeout and `BEGIN IMMEDIATE` for writes.

    SQLite is shared by several local processes (scheduler, coordinator, CLI): WAL lets readers run beside the
    writer, and taking the write lock at BEGIN avoids the deadlock of two readers upgrading at once.
    Read-only work passes `execution_options(readonly=True)` to start a deferred transaction instead.

    `idle_in_transaction_timeout_s` (PostgreSQL): the server ends a session that sits inside a transaction this
    long without sending anything, which frees its locks. The scheduler sets it so that a replica stopped
    (SIGSTOP, a VM pause) while holding the clock row cannot block the others past its leadership lease.
    """
    url = normalize_url(url)
    if make_url(url).get_backend_name() == "sqlite":
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("readonly") else "BEGIN IMMEDIATE")

        return engine
    connect_args = {}
    if idle_in_transaction_timeout_s:
        connect_args["options"] = (
            f"-c idle_in_transaction_session_timeout={max(1, int(idle_in_transaction_timeout_s * 1000))}"
        )
    return create_engine(
        url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, connect_args=connect_args
    )
