"""The ``phalanx`` verbs that look at the cluster: ``goodput`` (GPU-time accounting), ``nodes``, ``watch`` (a line or a
live table per change), ``web`` (the dashboard server) and ``logs`` (the ranks' output).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

from phalanx.client import Job, UnavailableError, resolve_target

from . import console, render
from .argtypes import bounded, parse_since
from .common import EXIT_OK, UsageError, add_json_flag


def cmd_goodput(args: argparse.Namespace) -> int:
    """``phalanx goodput``: GPU-time accounting of the cluster and of the newest jobs."""
    since = parse_since(args.since)
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must not be negative, got {args.limit}")
    if args.page_size is not None and args.page_size < 0:
        raise UsageError(f"--page-size must not be negative, got {args.page_size}")
    with console.client(args) as client:
        report = client.goodput(
            since=since, limit=args.limit or 0, page_size=args.page_size or 0, page_token=args.page_token or ""
        )
    console.emit(render.to_json(report.to_dict()) if args.json else render.goodput_report(report))
    return EXIT_OK


def cmd_nodes(args: argparse.Namespace) -> int:
    """``phalanx nodes``: every node; ``--json`` prints one array."""
    with console.client(args) as client:
        nodes = client.nodes()
    if args.json:
        console.emit(render.to_json([n.to_dict() for n in nodes]))
    else:
        console.emit(render.nodes_table(nodes))
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    """``phalanx watch ID...``: a line (or JSON object) per change until every job has finished."""
    ids = list(dict.fromkeys(args.job_ids))
    live = None
    if not args.json and console.out().isatty():  # a terminal: one table, updated in place (piped: a line per change)
        from rich.console import Console
        from rich.live import Live

        live = Live(console=Console(file=console.out()), auto_refresh=False, transient=False)

    def emit(job: Job) -> None:
        if live is not None:
            live.update(render.watch_table(list(last.values())), refresh=True)
        elif args.json:
            console.emit(render.to_json(dict(job.to_dict(), changed_at=job.changed_at), lines=True))
        else:
            console.emit(render.watch_line(job))

    with console.client(args) as client, live if live is not None else contextlib.nullcontext():
        last: dict[str, Job] = {}
        for job_id in ids:  # NOT_FOUND fails fast, and every job gets a first line even if already finished
            job = client.get_job(job_id)
            job = dataclasses.replace(job, changed_at=job.finished_at or job.started_at or job.submitted_at)
            last[job_id] = job
            emit(job)
        pending = {j for j, job in last.items() if not job.terminal}
        if not pending:
            return EXIT_OK
        stream = client.watch(sorted(pending))
        try:
            for job in stream:
                if job.id not in pending or last.get(job.id) == job:
                    continue
                last[job.id] = job
                emit(job)
                if job.terminal:
                    pending.discard(job.id)
                    if not pending:
                        break
        finally:
            stream.close()
    if pending:
        raise UnavailableError(
            f"the scheduler at {args.scheduler or resolve_target(None)} ended the watch before "
            f"{', '.join(sorted(pending))} finished"
        )
    return EXIT_OK


def cmd_web(args: argparse.Namespace) -> int:
    """``phalanx web [--scheduler ADDR] [--host H] [--port P] [--tls-cert F --tls-key F | --insecure]``: serve the
    dashboard until interrupted. Visitors sign in with their own tokens; the dashboard holds none."""
    import signal
    import threading

    from phalanx.web.server import InsecureBind, WebServer

    scheduler = args.web_scheduler or args.scheduler or resolve_target(None)
    if args.web_token is not None:
        sys.stderr.write(
            "phalanx web: --token is no longer used: the dashboard holds no credential of its own, each visitor "
            "signs in with theirs\n"
        )
    try:
        server = WebServer(
            scheduler,
            args.host,
            args.port,
            checkpoint=args.checkpoint_coordinator,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            insecure=args.insecure,
            session_ttl_s=args.session_ttl,
        ).start()
    except InsecureBind as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # ssl.SSLError (a bad certificate or key) is one
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    sys.stderr.write(f"dashboard at {server.url} (scheduler {scheduler}); sign in with your token; Ctrl-C stops it\n")
    sys.stderr.flush()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop()
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    """``phalanx logs JOB [--rank R] [--attempt A] [--follow] [--tail N]``: rank output; every rank's lines
    prefixed by their rank unless one is asked."""
    prefix = args.rank is None
    # A rank's output is its tenant's: on a terminal its control characters (escape sequences that set the title,
    # write the clipboard, clear or hide lines; carriage returns) are shown as visible escapes, not obeyed. Into a
    # pipe or a file the lines go as written.
    safe = console.out().isatty()
    with console.client(args) as client:
        for rank, line in client.logs(
            args.job_id, rank=args.rank, attempt=args.attempt, follow=args.follow, tail=args.tail
        ):
            if safe:
                line = line.translate(_VISIBLE_CONTROLS)
            console.emit(f"[rank {rank}] {line}" if prefix else line)
    return EXIT_OK


# C0 controls but tab, DEL and the C1 controls (U+0080-U+009F: 8-bit CSI, OSC, ...) -> "\xNN".
_VISIBLE_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F, *range(0x80, 0xA0))}


# -- parser ----------------------------------------------------------------------------------------------------


def register(sub) -> None:
    """Add ``goodput``, ``nodes``, ``watch``, ``web`` and ``logs`` to the ``phalanx`` subcommands `sub`."""
    p = sub.add_parser("goodput", help="GPU-time accounting: allocated, productive, rollback, restart, waiting")
    p.add_argument(
        "--since",
        default=None,
        metavar="UNIX_OR_ISO",
        help="only jobs submitted at or after this time: unix seconds or ISO 8601 (UTC by default)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="at most N jobs listed, newest first (default: the scheduler's, 100); the totals count all",
    )
    p.add_argument("--page-size", type=int, default=None, metavar="N", help="jobs per page (default: --limit)")
    p.add_argument(
        "--page-token", default=None, metavar="TOKEN", help="the next page of jobs: the token the previous page gave"
    )
    add_json_flag(p)
    p.set_defaults(func=cmd_goodput)

    p = sub.add_parser("nodes", help="list nodes")
    add_json_flag(p)
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("watch", help="print a line per change of the jobs until all have finished")
    p.add_argument("job_ids", nargs="+", metavar="ID")
    p.add_argument("--json", action="store_true", help="one JSON job object per line")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("web", help="a live web dashboard of the cluster (read-only), until Ctrl-C")
    p.add_argument("--scheduler", dest="web_scheduler", default=None, metavar="ADDR", help="as the global flag")
    p.add_argument(
        "--token",
        dest="web_token",
        default=None,
        metavar="TOKEN",
        help="no longer used (visitors sign in with their own tokens); accepted for old scripts",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="HOST",
        help="address to serve on (default 127.0.0.1); beyond loopback needs --tls-cert/--tls-key or --insecure",
    )
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain HTTP beyond loopback (only behind a proxy that terminates TLS)",
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=8 * 3600.0,
        metavar="S",
        help="seconds a sign-in lasts (default 28800)",
    )
    p.add_argument("--port", type=bounded("--port", 0, 65535), default=8080, metavar="P", help="default 8080")
    p.add_argument(
        "--checkpoint-coordinator",
        default=os.environ.get("PHALANX_CHECKPOINT_ADDR") or None,
        metavar="ADDR",
        help="the checkpoint coordinator, for the checkpoints on a job's page (env PHALANX_CHECKPOINT_ADDR)",
    )
    p.set_defaults(func=cmd_web)

    p = sub.add_parser("logs", help="a job's rank logs (stdout and stderr), from the ranks' nodes")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--rank", type=bounded("--rank", 0), default=None, metavar="R", help="one rank (default: all)")
    p.add_argument(
        "--attempt", type=bounded("--attempt", 1), default=0, metavar="A", help="an attempt (default: the last)"
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what the ranks write until they end")
    p.add_argument("--tail", type=bounded("--tail", 1), default=0, metavar="N", help="only each rank's last N lines")
    p.set_defaults(func=cmd_logs)
