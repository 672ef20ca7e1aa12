"""The clock row: a cycle's generation under its lock, and the leader's lease."""

from __future__ import annotations

import time
from typing import NamedTuple

import psycopg
from sqlalchemy import Connection, or_, select, update

from db.models import LedgerClock

from .jobs import StaleJobs


class Clock(NamedTuple):
    """The clock row as a cycle finds it under its lock: the generation and who leads (see `take_lease`)."""

    generation: int
    leader: str
    epoch: int
    until: float
    now: float  # the database's clock (PostgreSQL), so replicas on different hosts compare leases alike


def begin_cycle(conn: Connection) -> Clock:
    """Serialise scheduling transactions across replicas; return the ledger generation and the leadership lease.

    On PostgreSQL the row lock on the clock row (held to commit) makes cycles of different replicas take turns,
    so their other row locks can never deadlock and each cycle decides on a view no older than the last commit;
    SQLite's BEGIN IMMEDIATE already does this. The generation tells whether anyone else wrote since this
    replica's last cycle. The lease columns change only under this same lock, so what a cycle reads here holds
    until it commits.
    """
    if conn.dialect.name == "postgresql":
        # Pipelined, psycopg sends its BEGIN and this query together: one round trip where there were two.
        # (On the driver's connection: SQLAlchemy wants a result's columns before a pipeline has them.)
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.pipeline():
            cursor = driver.execute(
                "SELECT generation, leader, leader_epoch, leader_until, extract(epoch FROM clock_timestamp())::float8 "
                "FROM ledger_clock WHERE id = 1 FOR UPDATE"
            )
            row = cursor.fetchone()
        return Clock(int(row[0]), row[1] or "", int(row[2] or 0), float(row[3] or 0.0), float(row[4]))
    row = conn.execute(
        select(LedgerClock.generation, LedgerClock.leader, LedgerClock.leader_epoch, LedgerClock.leader_until).where(
            LedgerClock.id == 1
        )
    ).one()
    return Clock(int(row[0]), row[1] or "", int(row[2] or 0), float(row[3] or 0.0), time.time())


FENCE_REFUSED = "fence: "  # how phalanx_fence's refusals begin (revision 0027)


def fence(conn: Connection, generation: int, replica: str, epoch: int) -> None:
    """Take the clock row's lock, checked: the transaction fails (SQLSTATE 40001, at the latest at its COMMIT)
    unless the row still holds `generation` and this replica's lease of `epoch`, unexpired by the database's clock.

    PostgreSQL only (phalanx_fence, revision 0027). It needs no answer, so a leader sends it first in its closing
    pipeline instead of waiting for begin_cycle's lock before deciding: the single-writer rule and the turn-taking
    of cycles are those of begin_cycle, checked by the server in the transaction that writes (the lock is held to
    the commit, and it is the first row the transaction locks, so the lock order of every writer is unchanged).
    Outside a pipeline it waits, as begin_cycle does."""
    driver = conn.connection.driver_connection
    assert driver is not None
    try:
        with driver.cursor() as cursor:
            cursor.execute("SELECT phalanx_fence(%s, %s, %s)", (generation, replica, epoch))
    except psycopg.errors.SerializationFailure as exc:  # (sent alone: in a pipeline it fails the COMMIT instead)
        raise FenceRefused(str(exc).splitlines()[0]) from exc


class FenceRefused(StaleJobs):
    """The fence found the ledger moved since the view was built on it, or the lease lost: nothing may commit."""


def fence_refused(exc: BaseException) -> bool:
    """Whether a failed transaction was refused by its fence (another writer, or the lease lost), raised here or,
    from the closing pipeline, by the COMMIT."""
    return isinstance(exc, FenceRefused) or FENCE_REFUSED in str(getattr(exc, "orig", exc))


def take_lease(conn: Connection, clock: Clock, replica: str, lease_s: float, *, epoch: int | None) -> Clock | None:
    """Acquire or renew the leadership lease; the caller holds the clock row (begin_cycle).

    `epoch`: the epoch this replica holds (renewal), None to acquire (the row must be free or expired; the epoch
    goes up by one). Fenced: the statement's WHERE clause checks the epoch the caller read, and a renewal the
    leader and epoch it holds, so a deposed leader's renewal changes nothing. Returns the new row, None when
    refused."""
    until = clock.now + lease_s
    if epoch is None:
        new_epoch = clock.epoch + 1
        stmt = (
            update(LedgerClock)
            .where(
                LedgerClock.id == 1,
                LedgerClock.leader_epoch == clock.epoch,
                or_(LedgerClock.leader == "", LedgerClock.leader == replica, LedgerClock.leader_until < clock.now),
            )
            .values(leader=replica, leader_epoch=new_epoch, leader_until=until)
        )
    else:
        new_epoch = epoch
        stmt = (
            update(LedgerClock)
            .where(LedgerClock.id == 1, LedgerClock.leader == replica, LedgerClock.leader_epoch == epoch)
            .values(leader_until=until)
        )
    if conn.execute(stmt).rowcount != 1:
        return None
    return clock._replace(leader=replica, epoch=new_epoch, until=until)


def release_lease(conn: Connection, replica: str, epoch: int) -> bool:
    """Give the lease up (a graceful stop), so another replica leads at once instead of after the lease."""
    return (
        conn.execute(
            update(LedgerClock)
            .where(LedgerClock.id == 1, LedgerClock.leader == replica, LedgerClock.leader_epoch == epoch)
            .values(leader="", leader_until=0.0)
        ).rowcount
        == 1
    )
