"""Apply the Alembic migrations in `migrations/` programmatically (`phalanx db upgrade`)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

from .engine import make_engine, normalize_url
from .models import LedgerIdentity


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision in `migrations/`: what `upgrade` brings a ledger to."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise RuntimeError("migrations/ holds no revision")
    return head


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (creates the SQLite file if needed)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
            if _has_identity_table(conn):
                ensure_cluster_id(conn)
                conn.commit()
    finally:
        engine.dispose()


def _has_identity_table(conn) -> bool:
    from sqlalchemy import inspect

    return inspect(conn).has_table(LedgerIdentity.__tablename__)


def read_cluster_id(conn) -> str:
    """The ledger's cluster id (revision 0015's `ledger_identity` row), "" when it has none."""
    from sqlalchemy import select

    return conn.execute(select(LedgerIdentity.cluster_id).where(LedgerIdentity.id == 1)).scalar() or ""


def ensure_cluster_id(conn) -> str:
    """The ledger's cluster id, a random UUID written now if the ledger has none yet (revision 0015 writes it; this
    covers a row lost since, e.g. tables emptied). Idempotent and safe against a concurrent writer: the row has a
    fixed key, and whichever insert wins is the id everyone reads. Runs in the caller's transaction."""
    found = read_cluster_id(conn)
    if found:
        return found
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(
        dialect_insert(LedgerIdentity)
        .values(id=1, cluster_id=str(uuid.uuid4()), created_at=time.time())
        .on_conflict_do_nothing(index_elements=["id"])
    )
    return read_cluster_id(conn)


def ensure_rank_key(conn) -> str:
    """The key that signs the ranks' credentials (64 hex digits), made now if the ledger has none. Safe against a
    concurrent writer (only an empty key is replaced, and everyone reads the winner's). Runs in the caller's
    transaction."""
    import secrets

    from sqlalchemy import select, update

    ensure_cluster_id(conn)
    conn.execute(
        update(LedgerIdentity)
        .where(LedgerIdentity.id == 1, LedgerIdentity.rank_key == "")
        .values(rank_key=secrets.token_hex(32))
    )
    return str(conn.execute(select(LedgerIdentity.rank_key).where(LedgerIdentity.id == 1)).scalar() or "")


def cluster_id(url: str) -> str:
    """The cluster id of the ledger at `url` ("" before revision 0015)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if not _has_identity_table(conn):
                return ""
            return read_cluster_id(conn)
    finally:
        engine.dispose()


def current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
