"""Throwaway PostgreSQL databases beside a given one (the session's, or the server's admin database)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from sqlalchemy import create_engine, text


def create_database(beside_url: str, prefix: str) -> str:
    """A new, empty database on the server of `beside_url`, named `<prefix>_<random>`; its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(beside_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    base, _, _ = beside_url.rpartition("/")
    return f"{base}/{name}"


def drop_database(url: str, admin_url: str) -> None:
    """Drop the database of `url` (its sessions ended first), connected through `admin_url`."""
    name = url.rpartition("/")[2]
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        admin.dispose()


@contextlib.contextmanager
def scratch_database(beside_url: str, prefix: str) -> Iterator[str]:
    """A new, empty database for the block, dropped after it."""
    url = create_database(beside_url, prefix)
    try:
        yield url
    finally:
        drop_database(url, beside_url)
