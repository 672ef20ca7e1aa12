"""Retention of finished jobs: the archive (the scheduler's --retain-finished) and `phalanx db prune`.

A finished job (SUCCEEDED, FAILED, CANCELLED) stays in `jobs`, with its allocations, attempts, ranks, checkpoints and
events, for --retain-finished after it finished (default 30 days; 0 or `forever`: always). Then `archive_finished`
moves it into one compact `job_archive` row (revision 0016: what it was, how it ended, its goodput figures as
computed then, and `detail`: its command, tiers, placement, counts, each attempt's outcome and the checkpoints not
deleted), adds its figures and a count of one into `goodput_totals` (its tenant, queue and UTC day of submission)
unless they are there already (`jobs.accounted`: the leader's upkeep adds them soon after a job finished, see
accounting.account_finished), and deletes it and every row
that refers to it: the tables with a foreign key to jobs.id (and theirs, e.g.
checkpoint_shards), and the assignments its nodes acknowledged (an unacknowledged one stays for its node's stream).
A job that still has an active allocation row (the `hold` of a GPU that other jobs' shares still use) waits.

Batches: at most BATCH jobs per transaction, and at most MAX_BATCHES per run (the next run, CHECK_INTERVAL_S later,
goes on), so that no transaction holds the ledger long. The scheduler runs it on its reader threads, never inside a
scheduling cycle, and only on the leading replica (SchedulerService._retention). A job is archived once
whatever runs it: each batch is one transaction that inserts the archive rows (primary key: the job id), adds to the
sums and deletes the jobs, and rolls back whole (ArchiveConflict, nothing counted) unless it deleted every job it
read; PostgreSQL's `FOR UPDATE SKIP LOCKED` keeps two archivers off each other's batches, and SQLite's BEGIN
IMMEDIATE runs them one after the other. The figures enter the sums only for the jobs whose `accounted` flag the
batch itself sets (accounting.mark_accounted), so an archive and the scheduler's accounting never both count a job.

`account_backlog` accounts the finished jobs that are not yet, in batches, without archiving them, so that the
goodput total stops reading them. The leader runs it ACCOUNT_AFTER_S after each of its cycles that finished jobs, and
every CHECK_INTERVAL_S for the others (another replica's, those finished before revision 0016): MAX_BATCHES a run,
soon again while more are left (SchedulerService._account_soon); ``python -m services.scheduler.retention account``
runs it all at once.

`prune` (`phalanx db prune --before DATE --export FILE.jsonl`, which runs ``python -m services.scheduler.retention
prune``): every finished job that finished before DATE, still in `jobs` (with its attempts) or archived, is written
as one JSON line, the file is fsynced, and then the job is deleted (from `jobs` and every dependent table, or its
archive row), batch by batch: a batch's lines are on disk before its delete commits, so a crash loses nothing (a
rerun exports what was not deleted). goodput_totals keep every figure: a pruned job still in `jobs` is added to them
first unless accounted already, as the archive would, and a pruned archive row's figures are there already.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import structlog
from sqlalchemy import Connection, Engine, Table, and_, delete, exists, false, select, union_all
from sqlalchemy.exc import IntegrityError

from db.models import (
    TERMINAL_JOB_STATES,
    Allocation,
    Assignment,
    Base,
    Checkpoint,
    Job,
    JobArchive,
    Node,
)
from phalanx.api.v1 import common_pb2
from phalanx.core.goodput import CATEGORIES, Goodput

from . import ledger
from .accounting import account_finished, add_totals, job_goodput, mark_accounted, to_proto
from .convert import job_from_row

log = structlog.get_logger()


def _table(model: Any) -> Table:
    return cast(Table, model.__table__)


DEFAULT_RETAIN_FINISHED_S = 30 * 86400.0
CHECK_INTERVAL_S = 60.0  # how often the leader looks for finished jobs past the retention (and not accounted)
# The leader accounts the jobs its cycles finished this long after (SchedulerService._account_soon): the jobs of a
# quarter of a second share one transaction, and the goodput read computes at most that many from their attempts
ACCOUNT_AFTER_S = 0.25
ACCOUNT_RETRY_S = 5.0  # after a failed run
BATCH = 500  # jobs per transaction
MAX_BATCHES = 20  # transactions per run
_REASON_CHARS = 500


class ArchiveConflict(RuntimeError):
    """Another archiver (or prune) moved some of the batch's jobs first; the batch rolled back, nothing counted."""


def parse_retain(text: str) -> float:
    """``--retain-finished``: seconds ("86400"), or a number with a unit ("30d", "12h", "90m", "45s"); "0", "forever"
    or "never" keep finished jobs in `jobs` for ever (0.0). ValueError otherwise."""
    value = text.strip().lower()
    if value in ("forever", "never", "0"):
        return 0.0
    try:
        if value and value[-1] in "smhd":
            seconds = float(value[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[value[-1]]
        else:
            seconds = float(value)
    except ValueError:
        raise ValueError(
            f"--retain-finished: {text!r} is not a duration: give seconds, 30d, 12h, 90m, or 0 / forever"
        ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--retain-finished must be at least 0 seconds, got {text!r}")
    return seconds


# ---- what refers to a job ------------------------------------------------------------------------------------------


def _children(table: Table) -> Iterator[tuple[Table, Any, Any]]:
    """(table, its column, the referred column of `table`) for every foreign key of the ledger that refers to
    `table`."""
    for child in Base.metadata.sorted_tables:
        for fk in child.foreign_keys:
            if fk.column.table is table and child is not table:
                yield child, fk.parent, fk.column


def _delete_tree(conn: Connection, table: Table, where: Any, depth: int = 0) -> int:
    """Delete the rows of `table` matching `where` and, first, every row that refers to them (recursively)."""
    if depth > 4:
        raise RuntimeError(f"foreign keys nest too deep under {table.name}")
    for child, column, referred in _children(table):
        _delete_tree(conn, child, column.in_(select(referred).where(where).scalar_subquery()), depth + 1)
    return conn.execute(delete(table).where(where)).rowcount


def _delete_jobs(conn: Connection, ids: Sequence[str]) -> int:
    """Delete the finished jobs `ids` and every row about them; returns how many jobs were deleted."""
    assignments, nodes = _table(Assignment), _table(Node)
    acked = select(nodes.c.acked_revision).where(nodes.c.id == assignments.c.node_id).scalar_subquery()
    conn.execute(delete(assignments).where(assignments.c.job_id.in_(list(ids)), assignments.c.revision <= acked))
    jobs = _table(Job)
    return _delete_tree(conn, jobs, and_(jobs.c.id.in_(list(ids)), jobs.c.state.in_(TERMINAL_JOB_STATES)))


# ---- the archive -----------------------------------------------------------------------------------------------------


def _due(conn: Connection, before: float, limit: int, *, lock: bool, skip_locked: bool = True) -> list[str]:
    """Ids of finished jobs in `jobs` that finished before `before` and hold no active allocation row, oldest first.
    `lock` (PostgreSQL): lock them for this transaction (`skip_locked`: leave those another transaction locked).

    One ordered, limited scan of the (state, finished_at) index per final state, merged: a single query over the
    three states would sort every job past the retention before taking `limit` of them (half a second with 50,000
    due, on every batch). Locked by id afterwards, with the same conditions checked again."""
    jobs, alloc = _table(Job), _table(Allocation)

    def idle(table: Any) -> Any:
        return ~exists().where(alloc.c.job_id == table.c.id, alloc.c.released_at.is_(None))

    parts = [
        select(jobs.c.id, jobs.c.finished_at)
        .where(jobs.c.state == state, jobs.c.finished_at < before, idle(jobs))
        .order_by(jobs.c.finished_at, jobs.c.id)
        .limit(limit)
        .subquery()
        for state in TERMINAL_JOB_STATES
    ]
    merged = union_all(*(select(p.c.id, p.c.finished_at) for p in parts)).subquery()
    rows = conn.execute(select(merged.c.id).order_by(merged.c.finished_at, merged.c.id).limit(limit)).scalars()
    ids = list(rows)
    if not (ids and lock and conn.dialect.name == "postgresql"):
        return ids
    stmt = (
        select(jobs.c.id)
        .where(jobs.c.id.in_(ids), jobs.c.state.in_(TERMINAL_JOB_STATES), jobs.c.finished_at < before, idle(jobs))
        .with_for_update(of=jobs, skip_locked=skip_locked)
    )
    locked = set(conn.execute(stmt).scalars())
    return [i for i in ids if i in locked]


def load_jobs(conn: Connection, ids: Sequence[str]) -> tuple[list[Any], dict[str, list[Any]]]:
    """The finished jobs among `ids` (whole rows) and their job_attempts rows."""
    jobs = _table(Job)
    rows = list(
        conn.execute(
            select(jobs).where(jobs.c.id.in_(list(ids)), jobs.c.state.in_(TERMINAL_JOB_STATES)).order_by(jobs.c.id)
        ).mappings()
    )
    return rows, ledger.read_attempts(conn, [r["id"] for r in rows]) if rows else {}


def _kept_checkpoints(conn: Connection, ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    c = _table(Checkpoint)
    out: dict[str, list[dict[str, Any]]] = {}
    stmt = (
        select(c.c.job_id, c.c.id, c.c.attempt, c.c.step)
        .where(c.c.job_id.in_(list(ids)), c.c.state == "COMMITTED", c.c.deleted_at.is_(None))
        .order_by(c.c.job_id, c.c.step)
    )
    for row in conn.execute(stmt):
        out.setdefault(row.job_id, []).append({"id": row.id, "attempt": row.attempt, "step": row.step})
    return out


def archive_row(job: Any, attempts: Sequence[Any], g: Goodput, now: float, checkpoints: list[Any]) -> dict[str, Any]:
    """The job_archive row of a finished job."""
    detail = {
        "command": list(job["command"] or []),
        "procs_per_replica": job["procs_per_replica"],
        "required_tier": job["required_tier"] or "",
        "preferred_tier": job["preferred_tier"] or "",
        "gpu_model": job["gpu_model"] or "",
        "max_restarts": job["max_restarts"] or 0,
        "time_limit": job["time_limit"] or 0.0,
        "keep_checkpoints": job["keep_checkpoints"] or 0,
        "placement": dict(job["placement"] or {}),
        "failures": job["failures"] or 0,
        "preemptions": job["preemptions"] or 0,
        "flavor": job["flavor"] or "",
        "request_id": job["request_id"] or "",
        "attempt": job["attempt"],
        "struck_nodes": list(job["struck_nodes"] or []),
        "attempts": [
            {"attempt": a["attempt"], "outcome": a["outcome"] or "", "reason": (a["reason"] or "")[:_REASON_CHARS]}
            for a in attempts
        ],
        # Committed checkpoints whose files the checkpoint coordinator had not deleted: they stay on disk.
        "checkpoints": checkpoints,
    }
    return {
        "id": job["id"],
        "name": job["name"],
        "tenant": job["tenant"] or "",
        "queue": job["queue"] or "default",
        "state": job["state"],
        "priority": job["priority"],
        "replicas": job["replicas"],
        "gpus_per_replica": job["gpus_per_replica"],
        "mig_profile": job["mig_profile"] or "",
        "gpu_milli": job["gpu_milli"] or 0,
        "submitted_at": job["submitted_at"],
        "started_at": job["started_at"] or 0.0,
        "finished_at": job["finished_at"],
        "exit_code": job["exit_code"],
        "message": job["message"] or "",
        "attempts": len(attempts),
        **g.as_dict(),
        "archived_at": now,
        "detail": detail,
    }


def archive_jobs(
    conn: Connection, jobs: Sequence[Any], attempts: dict[str, list[Any]], now: float, *, keep_rows: bool = True
) -> list[dict[str, Any]]:
    """Move finished jobs (`jobs`: whole rows, read in this or an earlier transaction; `attempts`: theirs) into the
    archive inside the caller's transaction: their archive rows (unless not `keep_rows`: prune), the figures of those
    not accounted yet into goodput_totals (their flag set first, as committed now: mark_accounted, whatever the rows
    read said), and the deletion of them and every row about them. ArchiveConflict when any of them was archived or
    deleted by someone else since they were read: the caller's transaction must roll back (nothing is counted)."""
    if not jobs:
        return []
    ids = [j["id"] for j in jobs]
    kept = _kept_checkpoints(conn, ids)
    rows = []
    for job in jobs:
        mine = attempts.get(job["id"], [])
        rows.append(archive_row(job, mine, job_goodput(job, mine, now), now, kept.get(job["id"], [])))
    try:
        if keep_rows:
            conn.execute(_table(JobArchive).insert(), rows)
        marked = mark_accounted(conn, ids)  # the accounted ones are in the sums already
        add_totals(conn, [r for r in rows if r["id"] in marked], now)
        deleted = _delete_jobs(conn, ids)
    except IntegrityError as exc:  # an archive row with that id exists: archived by another transaction
        raise ArchiveConflict(f"some of {len(ids)} jobs were archived by another transaction") from exc
    if deleted != len(ids):
        raise ArchiveConflict(f"{len(ids) - deleted} of {len(ids)} jobs were archived or deleted meanwhile")
    return rows


def archive_batch(conn: Connection, before: float, now: float, limit: int = BATCH) -> int:
    """One batch inside the caller's (writing) transaction: how many jobs it archived."""
    ids = _due(conn, before, limit, lock=True)
    jobs, attempts = load_jobs(conn, ids)
    return len(archive_jobs(conn, jobs, attempts, now))


def archive_finished(
    engine: Engine,
    before: float,
    *,
    now: float | None = None,
    batch: int = BATCH,
    max_batches: int = MAX_BATCHES,
) -> int:
    """Archive the finished jobs that finished before `before`, one transaction per batch, at most `max_batches`
    batches. Returns how many were archived. Looks first in a read-only transaction, so that a ledger with nothing
    due is not locked (SQLite) at all."""
    with engine.connect().execution_options(readonly=True) as conn, conn.begin():
        if not _due(conn, before, 1, lock=False):
            return 0
    total = 0
    for _ in range(max_batches):
        try:
            with engine.begin() as conn:
                n = archive_batch(conn, before, time.time() if now is None else now, batch)
        except ArchiveConflict as exc:  # another archiver got there first: its batch counted, ours did not
            log.info("finished_jobs_archive_conflict", error=str(exc))
            break
        total += n
        if n < batch:
            break
    if total:
        log.info("finished_jobs_archived", count=total, before=before)
    return total


def _unaccounted_finished(conn: Connection, limit: int) -> list[str]:
    """Ids of finished jobs in `jobs` not accounted yet, oldest first; locked
    for this transaction on PostgreSQL (skipping those another transaction holds)."""
    jobs = _table(Job)
    stmt = (
        select(jobs.c.id)
        .where(jobs.c.accounted == false(), jobs.c.state.in_(TERMINAL_JOB_STATES))
        .order_by(jobs.c.finished_at, jobs.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    return list(conn.execute(stmt).scalars())


def account_backlog(
    engine: Engine, *, now: float | None = None, batch: int = BATCH, max_batches: int | None = MAX_BATCHES
) -> int:
    """Account the finished jobs that are not accounted yet (accounting.account_finished), one transaction per batch,
    at most `max_batches` batches (None: until none is left); they stay in `jobs`. Returns how many it accounted."""
    total, batches = 0, 0
    while max_batches is None or batches < max_batches:
        batches += 1
        with engine.begin() as conn:
            ids = _unaccounted_finished(conn, batch)
            n = account_finished(conn, ids, time.time() if now is None else now) if ids else 0
        total += n
        if len(ids) < batch:
            break
    if total:
        log.debug("finished_jobs_accounted", count=total)  # (the leader's upkeep runs it every few cycles)
    return total


# ---- reading the archive ---------------------------------------------------------------------------------------------


def read_archived_job(conn: Connection, job_id: str, tenant: str | None = None) -> common_pb2.Job | None:
    """An archived job as a phalanx.v1.Job (GetJob): its spec as kept, state, times, message, exit code and goodput;
    no allocations, no env. None when it is not in the archive (or is another tenant's, with `tenant`)."""
    archive = _table(JobArchive)
    stmt = select(archive).where(archive.c.id == job_id)
    if tenant is not None:
        stmt = stmt.where(archive.c.tenant == tenant)
    row = conn.execute(stmt).mappings().first()
    if row is None:
        return None
    d = row["detail"] or {}
    job = job_from_row(
        {
            **{k: row[k] for k in ("id", "name", "state", "priority", "replicas", "gpus_per_replica", "tenant")},
            **{k: row[k] for k in ("queue", "mig_profile", "gpu_milli", "message", "exit_code", "submitted_at")},
            "started_at": row["started_at"],
            "finished_at": row["finished_at"],
            "procs_per_replica": d.get("procs_per_replica", 0),
            "command": d.get("command", []),
            "env": {},
            "required_tier": d.get("required_tier", ""),
            "preferred_tier": d.get("preferred_tier", ""),
            "gpu_model": d.get("gpu_model", ""),
            "max_restarts": d.get("max_restarts", 0),
            "time_limit": d.get("time_limit", 0.0),
            "keep_checkpoints": d.get("keep_checkpoints", 0),
            "attempt": d.get("attempt", row["attempts"]),
            "placement": d.get("placement") or {},
            "failures": d.get("failures", 0),
            "preemptions": d.get("preemptions", 0),
            "flavor": d.get("flavor", ""),
            "struck_nodes": d.get("struck_nodes", []),
        },
        (),
    )
    job.goodput.CopyFrom(to_proto(Goodput(**{c: float(row[c]) for c in CATEGORIES})))
    return job


# ---- prune -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PruneResult:
    exported: int
    deleted: int
    file: str


def _plain(row: Any) -> dict[str, Any]:
    return {k: row[k] for k in row.keys()}


def _write(out: Any, lines: list[dict[str, Any]]) -> None:
    for line in lines:
        out.write(json.dumps(line, separators=(",", ":"), default=str) + "\n")
    out.flush()
    os.fsync(out.fileno())


def prune(
    engine: Engine, before: float, export: str | None, *, now: float | None = None, batch: int = BATCH
) -> PruneResult:
    """Export (unless `export` is None) and delete every finished job that finished before `before`, in `jobs` or in
    the archive (see the module's docstring). The export file must not exist yet (it is never overwritten)."""
    out = open(export, "x", encoding="utf-8") if export else None  # closed below
    exported = deleted = 0
    try:
        while True:  # the finished jobs still in `jobs`: into goodput_totals, then gone
            with engine.begin() as conn:
                ids = _due(conn, before, batch, lock=True, skip_locked=False)
                if not ids:
                    break
                jobs, attempts = load_jobs(conn, ids)
                when = time.time() if now is None else now
                lines = []
                for job in jobs:
                    mine = attempts.get(job["id"], [])
                    lines.append(
                        {
                            "source": "jobs",
                            "job": _plain(job),
                            "attempts": [_plain(a) for a in mine],
                            "goodput": job_goodput(job, mine, when).as_dict(),
                        }
                    )
                if out is not None:
                    _write(out, lines)
                    exported += len(lines)
                deleted += len(archive_jobs(conn, jobs, attempts, when, keep_rows=False))
        archive = _table(JobArchive)
        while True:  # the archived ones: their figures are in goodput_totals already
            with engine.begin() as conn:
                stmt = (
                    select(archive)
                    .where(archive.c.finished_at < before)
                    .order_by(archive.c.finished_at, archive.c.id)
                    .limit(batch)
                )
                if conn.dialect.name == "postgresql":
                    stmt = stmt.with_for_update()
                rows = list(conn.execute(stmt).mappings())
                if not rows:
                    break
                if out is not None:
                    _write(
                        out,
                        [
                            {"source": "job_archive", "job": _plain(r), "goodput": {c: r[c] for c in CATEGORIES}}
                            for r in rows
                        ],
                    )
                    exported += len(rows)
                gone = conn.execute(delete(archive).where(archive.c.id.in_([r["id"] for r in rows]))).rowcount
                if gone != len(rows):
                    raise ArchiveConflict(f"{len(rows) - gone} archive rows were deleted meanwhile; run prune again")
                deleted += gone
    finally:
        if out is not None:
            out.close()
    if export:
        directory = os.open(str(Path(export).resolve().parent), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    log.info("finished_jobs_pruned", exported=exported, deleted=deleted, before=before, file=export or "")
    return PruneResult(exported=exported, deleted=deleted, file=export or "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m services.scheduler.retention prune --db URL --before UNIX (--export FILE | --no-export)``: one JSON
    line ``{"exported", "deleted", "file"}``; ``... account --db URL``: accounts every finished job not accounted yet
    (account_backlog), one JSON line ``{"accounted"}``. On failure one ``error: ...`` line on standard error, exit
    code 1 (2: a usage error)."""
    parser = argparse.ArgumentParser(prog="python -m services.scheduler.retention")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prune", help="export and delete finished jobs that finished before a time")
    p.add_argument("--db", required=True, metavar="URL")
    p.add_argument("--before", required=True, type=float, metavar="UNIX")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--export", metavar="FILE")
    which.add_argument("--no-export", action="store_true")
    a = sub.add_parser("account", help="add the finished jobs not accounted yet to goodput_totals")
    a.add_argument("--db", required=True, metavar="URL")
    args = parser.parse_args(argv)
    if args.command == "prune":
        if not math.isfinite(args.before) or args.before < 0 or args.before > time.time():
            sys.stderr.write(f"error: --before must be a time in the past, got {args.before}\n")
            return 2
        if args.export and os.path.exists(args.export):
            sys.stderr.write(f"error: {args.export} exists already; prune never overwrites an export\n")
            return 2
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))

    from db.engine import make_engine

    try:
        engine = make_engine(args.db)
        try:
            if args.command == "account":
                accounted = account_backlog(engine, max_batches=None)
            else:
                result = prune(engine, args.before, None if args.no_export else args.export)
        finally:
            engine.dispose()
    except Exception as exc:  # one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(f"error: {type(exc).__name__}: {first}\n")
        return 1
    if args.command == "account":
        print(json.dumps({"accounted": accounted}))
    else:
        print(json.dumps({"exported": result.exported, "deleted": result.deleted, "file": result.file}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
