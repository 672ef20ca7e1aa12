"""``phalanx db upgrade`` and ``phalanx db prune``: the ledger's migrations and retention, each run by the ledger's
own tool in a process of its own (the CLI never imports the ledger's code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

from . import console, render
from .argtypes import parse_since
from .common import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Parser, UsageError, add_json_flag


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """``phalanx db upgrade``: apply the migrations to ``--db`` and print the revision reached.

    The ledger's own tool (``python -m db upgrade``) does the work in a process of its own: the CLI does not import
    the ledger's code.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "db", "upgrade", "--db", args.db],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        message = errors[-1][len("error: ") :] if errors else (proc.stderr.strip().splitlines() or [""])[-1]
        console.error(message or f"python -m db upgrade exited {proc.returncode}")
        return EXIT_ERROR
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        console.emit(
            render.to_json(
                {"db": result["db"], "revision": result["revision"], "cluster_id": result.get("cluster_id", "")}
            )
        )
    else:
        console.emit(
            f"database {result['db']} is at revision {result['revision']} (cluster id {result.get('cluster_id')})"
        )
    return EXIT_OK


def cmd_db_prune(args: argparse.Namespace) -> int:
    """``phalanx db prune --before DATE --export FILE.jsonl``: write every finished job that finished before DATE
    (still in the jobs table, with its attempts, or archived) to FILE as one JSON line each, fsync it, then delete
    them; goodput totals keep their figures. ``--no-export`` deletes without a copy. Refused (usage error, nothing
    changed): no --export nor --no-export, both, a bad or future DATE, an existing FILE.

    Like ``db upgrade``, the ledger's side runs in a process of its own (``python -m services.scheduler.retention
    prune``).
    """
    if args.export is None and not args.no_export:
        raise UsageError(
            "--export FILE.jsonl is required: every pruned job is written there before it is deleted "
            "(--no-export deletes them without a copy)"
        )
    if args.export is not None and args.no_export:
        raise UsageError("give --export FILE.jsonl or --no-export, not both")
    if not args.before.strip():
        raise UsageError("--before expects unix seconds or an ISO 8601 time, got ''")
    before = parse_since(args.before, "--before")
    if before > datetime.now(UTC).timestamp():
        raise UsageError(f"--before {args.before!r} is in the future: only jobs that finished before now can be pruned")
    if args.export is not None and (not args.export.strip() or os.path.exists(args.export)):
        raise UsageError(f"--export {args.export!r}: give a new file (prune never overwrites one)")
    where = ["--export", args.export] if args.export is not None else ["--no-export"]
    proc = subprocess.run(
        [sys.executable, "-m", "services.scheduler.retention", "prune", "--db", args.db, "--before", repr(before)]
        + where,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        message = errors[-1][len("error: ") :] if errors else (proc.stderr.strip().splitlines() or [""])[-1]
        console.error(message or f"prune exited {proc.returncode}")
        return EXIT_USAGE if proc.returncode == EXIT_USAGE else EXIT_ERROR
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        console.emit(
            render.to_json({"exported": result["exported"], "deleted": result["deleted"], "file": result["file"]})
        )
    elif args.export is not None:
        console.emit(
            f"exported {result['exported']} finished jobs to {result['file']}; deleted {result['deleted']} "
            f"(finished before {render.format_time(before)}; goodput totals keep their figures)"
        )
    else:
        console.emit(
            f"deleted {result['deleted']} finished jobs (finished before {render.format_time(before)}; no export; "
            "goodput totals keep their figures)"
        )
    return EXIT_OK


def default_db_url() -> str:
    """``--db`` when not given: $PHALANX_DB, else the local SQLite file."""
    env = os.environ.get("PHALANX_DB")
    if env:
        return env
    from phalanx.common.defaults import DEFAULT_DB_URL

    return DEFAULT_DB_URL


# -- parser ----------------------------------------------------------------------------------------------------


def register(sub) -> None:
    """Add ``db upgrade`` and ``db prune`` to the ``phalanx`` subcommands `sub`."""
    p = sub.add_parser("db", help="database administration")
    db_sub = p.add_subparsers(dest="db_command", metavar="SUBCOMMAND", parser_class=Parser)
    db_sub.required = True
    up = db_sub.add_parser("upgrade", help="apply the migrations (creates a SQLite file if needed)")
    up.add_argument(
        "--db", default=None, metavar="URL", help="database URL (default: $PHALANX_DB, else the local SQLite file)"
    )
    add_json_flag(up)
    up.set_defaults(func=cmd_db_upgrade)
    pr = db_sub.add_parser(
        "prune", help="export finished jobs that finished before DATE to a JSON-lines file, then delete them"
    )
    pr.add_argument(
        "--before",
        required=True,
        metavar="DATE",
        help="jobs that finished before this time: unix seconds or ISO 8601 (UTC by default); not in the future",
    )
    pr.add_argument(
        "--export", default=None, metavar="FILE.jsonl", help="write every pruned job here first (a new file; fsynced)"
    )
    pr.add_argument("--no-export", action="store_true", help="delete without writing them anywhere")
    pr.add_argument(
        "--db", default=None, metavar="URL", help="database URL (default: $PHALANX_DB, else the local SQLite file)"
    )
    add_json_flag(pr)
    pr.set_defaults(func=cmd_db_prune)
