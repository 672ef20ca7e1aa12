"""The ``phalanx`` command line: submit, list, inspect, cancel, checkpoint and watch jobs; GPU-time accounting
(goodput); list, drain and undrain nodes; make tokens; migrate the database.

This is a stable contract that scripts depend on:

* standard output carries only the command's result (with ``--json``: exactly one JSON document, or one JSON
  object per line for ``watch --json``); logs and errors go to standard error;
* exit codes: 0 success, 1 an RPC or runtime error (stderr ``error: <CODE_NAME>: <message>``), 2 a usage error
  (bad flags, reserved flags that are not supported yet), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TextIO

from phalanx import __version__
from phalanx.client import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    Client,
    Job,
    JobState,
    PhalanxError,
    RPCError,
    UnavailableError,
    resolve_target,
)
from phalanx.core.preemption import PRIORITY_CLASSES, parse_priority
from phalanx.core.resources import cpu_milli, parse_size

from . import render
from .common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from .common import Parser as _Parser

__all__ = ["main", "build_parser", "UsageError", "RESERVED_SUBMIT_FLAGS", "TIER_SUBMIT_FLAGS", "GPU_SUBMIT_FLAGS"]

# Topology flags of `phalanx submit` (SubmitJob's JobSpec.required_tier / preferred_tier): a tier name, "node", a
# fabric tier of the scheduler ("leaf", "spine", ...) or "cluster". The scheduler checks the name.
TIER_SUBMIT_FLAGS = (
    "--required-tier",
    "--preferred-tier",
)

# Partial-GPU and model flags of `phalanx submit` (JobSpec.mig_profile / gpu_milli / gpu_model).
GPU_SUBMIT_FLAGS = (
    "--mig",
    "--gpu-milli",
    "--gpu-model",
)

# Flags accepted by `phalanx submit` now and rejected until the scheduler implements them.
RESERVED_SUBMIT_FLAGS: tuple[str, ...] = ()

# -- helpers ---------------------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "30m", "2h", "1d", "1:30" (M:SS), "1:30:00" (H:MM:SS) or "2-00:00:00" (Slurm's
    D-HH:MM:SS). ValueError with the accepted forms otherwise."""
    value = text.strip().lower()
    forms = "seconds, 30m, 2h, 1d, H:MM:SS or D-HH:MM:SS"
    try:
        if value and value[-1] in "smhd" and value[:-1].replace(".", "", 1).isdigit():
            seconds = float(value[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[value[-1]]
        elif ":" in value or "-" in value:
            days, _, clock = value.rpartition("-")
            parts = [float(p) for p in clock.split(":")]
            if len(parts) > 3 or any(p < 0 for p in parts) or (days and not days.isdigit()):
                raise ValueError
            seconds = sum(p * 60**i for i, p in enumerate(reversed(parts))) + (int(days) * 86400 if days else 0)
        else:
            seconds = float(value)
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a duration: give {forms}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{text!r}: a time limit must be more than 0 seconds")
    return seconds


def _arg_type(parse):
    """An argparse `type` from a parser that raises ValueError: a bad value is a usage error (exit code 2)."""

    def convert(value: str):
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


_duration = _arg_type(parse_duration)

MAX_KEEP_CHECKPOINTS = 10_000  # the scheduler's limit on JobSpec.keep_checkpoints


def parse_keep_checkpoints(text: str) -> int:
    """``--keep-checkpoints``: a whole number of checkpoints, 1 to 10000."""
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of checkpoints") from None
    if not 1 <= value <= MAX_KEEP_CHECKPOINTS:
        raise ValueError(f"--keep-checkpoints must be 1 to {MAX_KEEP_CHECKPOINTS}, got {value}")
    return value


_keep_checkpoints = _arg_type(parse_keep_checkpoints)


def parse_cpus(text: str) -> float:
    """``--cpus-per-replica``: a count of CPUs, fractions to a thousandth (0.5, 8)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of CPUs") from None
    if value <= 0:
        raise ValueError(f"--cpus-per-replica must be more than 0, got {text.strip()}")
    cpu_milli(value)
    return value


def parse_memory(text: str) -> str:
    """``--memory-per-replica``: a size with a binary unit (512M, 64G); sent as given, checked here first."""
    parse_size(text)
    return text.strip()


def _bounded(name: str, low: int, high: int | None = None):
    """An argparse type: a whole number from `low` (to `high`), else a usage error (exit 2) naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{name} takes a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"{low} to {high}" if high is not None else f"at least {low}"
            raise ValueError(f"{name} must be {bound}, got {value}")
        return value

    parse.__name__ = name
    return _arg_type(parse)


_cpus = _arg_type(parse_cpus)
_memory = _arg_type(parse_memory)


def _out() -> TextIO:
    return sys.stdout


def _print(text: str) -> None:
    out = _out()
    out.write(text)
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()


def _client(args: argparse.Namespace) -> Client:
    try:
        return Client(
            args.scheduler,
            timeout=args.timeout,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"TLS settings: {exc}") from None


def _parse_env(pairs: Sequence[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _parse_states(values: Sequence[str] | None) -> list[JobState]:
    states: list[JobState] = []
    for value in values or ():
        for part in value.split(","):
            if part.strip():
                try:
                    states.append(JobState.parse(part))
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
    return states


_priority = _arg_type(parse_priority)  # ``--priority``: an integer or a class name


def _parse_since(value: str | None, flag: str = "--since") -> float:
    """``--since`` (or `flag`): unix seconds, or an ISO 8601 time (UTC unless it says otherwise); None or "" is 0
    (all)."""
    if value is None or not value.strip():
        return 0.0
    text = value.strip()
    try:
        since = float(text)
    except ValueError:
        try:
            when = datetime.fromisoformat(text)  # 3.11: any ISO 8601 form, "Z" included
        except ValueError:
            raise UsageError(f"{flag} expects unix seconds or an ISO 8601 time, got {value!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        since = when.timestamp()
    if not math.isfinite(since) or since < 0:
        raise UsageError(f"{flag} must be a time at or after 1970-01-01, got {value!r}")
    return since


def _show_job(job: Job, as_json: bool) -> None:
    _print(render.to_json(job.to_dict()) if as_json else render.job_detail(job))


# -- commands --------------------------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    """``phalanx submit``: submit a job and print it (rejects the reserved flags with exit code 2)."""
    for flag in RESERVED_SUBMIT_FLAGS:
        if getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None:
            raise UsageError(f"{flag} is not supported yet")
    command = list(args.command or [])
    if not command:
        raise UsageError("a command is required: phalanx submit ... -- CMD ARGS...")
    if not args.name.strip():
        raise UsageError("--name must not be empty")
    if args.mig and args.gpu_milli:
        raise UsageError("ask for --mig or --gpu-milli, not both")
    if (args.mig or args.gpu_milli) and args.gpus_per_replica not in (None, 1):
        raise UsageError("a replica on a MIG instance or a GPU share uses one GPU: leave out --gpus-per-replica")
    partial = bool(args.mig) or bool(args.gpu_milli)
    if args.gpus_per_replica is None:
        if not partial:
            raise UsageError("--gpus-per-replica is required (it may be left out with --mig or --gpu-milli)")
        args.gpus_per_replica = 1
    env = _parse_env(args.env)
    with _client(args) as client:
        job = client.submit(
            args.name,
            args.replicas,
            args.gpus_per_replica,
            command,
            priority=args.priority,
            procs_per_replica=args.procs_per_replica,
            env=env,
            required_tier=args.required_tier or "",
            preferred_tier=args.preferred_tier or "",
            gpu_model=args.gpu_model or "",
            mig_profile=args.mig or "",
            gpu_milli=args.gpu_milli or 0,
            max_restarts=args.max_restarts,
            time_limit=args.time_limit or 0.0,
            queue=args.queue or "",
            keep_checkpoints=args.keep_checkpoints or 0,
            cpus_per_replica=args.cpus_per_replica or 0,
            memory_per_replica=args.memory_per_replica or "",
        )
    _show_job(job, args.json)
    return EXIT_OK


JOBS_PAGE_MAX = 1000  # the scheduler's largest ListJobs page (services/scheduler/paging.py)
ALL_PAGE_SIZE = 1000  # `phalanx jobs --all` asks for pages this large


def cmd_jobs(args: argparse.Namespace) -> int:
    """``phalanx jobs``: one page of jobs, newest first (the newest 100, ``--limit N`` of them, ``--page-token T``
    the page a previous one named), or every page (``--all``, printed as each arrives). The table ends with
    ``next page: phalanx jobs ... --page-token T`` when more follow; ``--json`` prints one object
    ``{"jobs": [...], "next_page_token": "..."}`` ("" on the last page, and with ``--all``)."""
    states = _parse_states(args.state)
    if args.all and args.limit is not None:
        raise UsageError("--limit and --all cannot be used together: --all lists every page")
    if args.limit is not None and not 1 <= args.limit <= JOBS_PAGE_MAX:
        raise UsageError(f"--limit must be 1 to {JOBS_PAGE_MAX}, got {args.limit}")
    token = args.page_token or ""
    with _client(args) as client:
        if args.all:
            return _all_jobs(client, states, token, args.json)
        jobs, token = client.list_jobs_page(states or None, page_size=args.limit or 0, page_token=token)
    if args.json:
        _print(render.to_json({"jobs": [j.to_dict() for j in jobs], "next_page_token": token}))
        return EXIT_OK
    _print(render.jobs_table(jobs))
    if token:
        command = ["phalanx", "jobs"]
        if states:
            command += ["--state", *dict.fromkeys(s.value for s in states)]
        if args.limit is not None:
            command += ["--limit", str(args.limit)]
        _print(render.next_page_hint(" ".join(command), token))
    return EXIT_OK


def _all_jobs(client: Client, states: list[JobState], token: str, as_json: bool) -> int:
    """``phalanx jobs --all``: follow every page from `token`, printing each page as it arrives (an error midway
    leaves the pages printed so far, and exits 1)."""

    def pages():
        nonlocal token
        while True:
            jobs, token = client.list_jobs_page(states or None, page_size=ALL_PAGE_SIZE, page_token=token)
            yield jobs
            if not token:
                return

    out = _out()
    if as_json:
        for chunk in render.jobs_json_stream(pages()):
            out.write(chunk)
            out.flush()
        return EXIT_OK
    table = render.JobsTableStream()
    for jobs in pages():
        text = table.page(jobs)
        if text:
            _print(text)
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    """``phalanx job ID``: one job."""
    with _client(args) as client:
        job = client.get_job(args.job_id)
    _show_job(job, args.json)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """``phalanx cancel ID``: cancel a job and print it."""
    with _client(args) as client:
        before = client.get_job(args.job_id)
        job = client.cancel(args.job_id)
    _show_job(job, args.json)
    if before.state.value in ("SUCCEEDED", "FAILED", "CANCELLED"):
        sys.stderr.write(f"note: job {job.id} had already finished ({before.state.value}); cancel changed nothing\n")
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``phalanx checkpoint ID``: ask a running job to checkpoint now; print the outstanding request."""
    reason = args.reason if args.reason is not None else "user"
    if not reason.strip():
        raise UsageError("--reason must not be empty")
    with _client(args) as client:
        result = client.checkpoint(args.job_id, reason=reason)
    _print(render.to_json(result.to_dict()) if args.json else render.checkpoint_result(result, asked=reason))
    return EXIT_OK


def cmd_goodput(args: argparse.Namespace) -> int:
    """``phalanx goodput``: GPU-time accounting of the cluster and of the newest jobs."""
    since = _parse_since(args.since)
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit must not be negative, got {args.limit}")
    if args.page_size is not None and args.page_size < 0:
        raise UsageError(f"--page-size must not be negative, got {args.page_size}")
    with _client(args) as client:
        report = client.goodput(
            since=since, limit=args.limit or 0, page_size=args.page_size or 0, page_token=args.page_token or ""
        )
    _print(render.to_json(report.to_dict()) if args.json else render.goodput_report(report))
    return EXIT_OK


def cmd_nodes(args: argparse.Namespace) -> int:
    """``phalanx nodes``: every node; ``--json`` prints one array."""
    with _client(args) as client:
        nodes = client.nodes()
    if args.json:
        _print(render.to_json([n.to_dict() for n in nodes]))
    else:
        _print(render.nodes_table(nodes))
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    """``phalanx watch ID...``: a line (or JSON object) per change until every job has finished."""
    ids = list(dict.fromkeys(args.job_ids))
    live = None
    if not args.json and _out().isatty():  # a terminal: one table, updated in place (piped: a line per change)
        from rich.console import Console
        from rich.live import Live

        live = Live(console=Console(file=_out()), auto_refresh=False, transient=False)

    def emit(job: Job) -> None:
        if live is not None:
            live.update(render.watch_table(list(last.values())), refresh=True)
        elif args.json:
            _print(render.to_json(dict(job.to_dict(), changed_at=job.changed_at), lines=True))
        else:
            _print(render.watch_line(job))

    with _client(args) as client, live if live is not None else contextlib.nullcontext():
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
    safe = _out().isatty()
    with _client(args) as client:
        for rank, line in client.logs(
            args.job_id, rank=args.rank, attempt=args.attempt, follow=args.follow, tail=args.tail
        ):
            if safe:
                line = line.translate(_VISIBLE_CONTROLS)
            _print(f"[rank {rank}] {line}" if prefix else line)
    return EXIT_OK


# C0 controls but tab, DEL and the C1 controls (U+0080-U+009F: 8-bit CSI, OSC, ...) -> "\xNN".
_VISIBLE_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F, *range(0x80, 0xA0))}


def cmd_node_drain(args: argparse.Namespace) -> int:
    """``phalanx node drain NAME``: (admin) take a node out of placement until undrained."""
    with _client(args) as client:
        node = client.drain_node(args.node_name, reason=args.reason or "")
    _print(render.to_json(node.to_dict()) if args.json else render.nodes_table([node]))
    return EXIT_OK


def cmd_node_undrain(args: argparse.Namespace) -> int:
    """``phalanx node undrain NAME``: (admin) put a drained node back (READY if its agent is alive)."""
    with _client(args) as client:
        node = client.undrain_node(args.node_name)
    _print(render.to_json(node.to_dict()) if args.json else render.nodes_table([node]))
    return EXIT_OK


def cmd_queue(args: argparse.Namespace) -> int:
    """``phalanx queue [QUEUE]``: quotas, use, share and pending jobs (in serving order) of every queue."""
    with _client(args) as client:
        queues = client.queues(args.name)
    _print(render.to_json([q.to_dict() for q in queues]) if args.json else render.queues_table(queues))
    return EXIT_OK


def parse_quota(text: str) -> tuple[str, dict[str, float]]:
    """``FLAVOR=GPUS[,borrow=N][,mig=N]`` -> (flavor, {"gpus", "borrow_limit", "mig_slices"})."""
    flavor, sep, rest = text.partition("=")
    parts = rest.split(",") if sep else []
    if not flavor.strip() or not parts:
        raise UsageError(f"--quota {text!r}: give FLAVOR=GPUS[,borrow=N][,mig=N], e.g. H100=64,borrow=16")
    out: dict[str, float] = {}
    try:
        out["gpus"] = float(parts[0])
        for part in parts[1:]:
            key, _, value = part.partition("=")
            name = {"borrow": "borrow_limit", "mig": "mig_slices"}.get(key.strip())
            if name is None or not value:
                raise ValueError
            out[name] = float(value)
    except ValueError:
        raise UsageError(f"--quota {text!r}: give FLAVOR=GPUS[,borrow=N][,mig=N] with numbers") from None
    return flavor.strip(), out


def cmd_quota_set(args: argparse.Namespace) -> int:
    """``phalanx quota set QUEUE --quota H100=64,borrow=16 ...``: (admin) create or replace a queue."""
    quotas: dict[str, dict[str, float]] = {}
    specs = list(args.quota) + ([f"*={args.gpus}"] if args.gpus is not None else [])
    for text in specs:
        flavor, quota = parse_quota(text)
        if flavor in quotas:
            raise UsageError(f"--quota: flavor {flavor!r} is given twice")
        quotas[flavor] = quota
    with _client(args) as client:
        queue = client.set_queue(
            args.queue,
            quotas,
            cohort=args.cohort,
            weight=args.weight,
            tenants=args.tenant,
            max_priority=args.max_priority,
        )
    _print(render.to_json(queue.to_dict()) if args.json else render.queues_table([queue]))
    return EXIT_OK


def cmd_quota_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_queue(args.queue)
    _print(render.to_json({"deleted": args.queue}) if args.json else f"queue {args.queue} deleted")
    return EXIT_OK


def cmd_token_new(args: argparse.Namespace) -> int:
    """``phalanx token new --tenant T [--role R] [--node NAME]``: a new token and its tokens-file entry (only the
    entry, with the token's SHA-256, goes in the scheduler's file; the token itself is shown once). A node token
    names the one node it may act as."""
    from phalanx.common.tokens import entry_line, new_token, token_entry

    if args.role == "node" and not args.node:
        raise UsageError("a node token names the node it acts as: --node NAME")
    token = new_token()
    try:
        entry = token_entry(token, args.tenant, args.role, args.node or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print(render.to_json({"token": token, "entry": entry}))
    else:
        _print(
            f"token: {token}\n"
            f"# add this entry to the tokens file (--tokens FILE); give the token to its user as PHALANX_TOKEN\n"
            f"{entry_line(entry)}"
        )
    return EXIT_OK


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
        _error(message or f"python -m db upgrade exited {proc.returncode}")
        return EXIT_ERROR
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        _print(
            render.to_json(
                {"db": result["db"], "revision": result["revision"], "cluster_id": result.get("cluster_id", "")}
            )
        )
    else:
        _print(f"database {result['db']} is at revision {result['revision']} (cluster id {result.get('cluster_id')})")
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
    before = _parse_since(args.before, "--before")
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
        _error(message or f"prune exited {proc.returncode}")
        return EXIT_USAGE if proc.returncode == EXIT_USAGE else EXIT_ERROR
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        _print(render.to_json({"exported": result["exported"], "deleted": result["deleted"], "file": result["file"]}))
    elif args.export is not None:
        _print(
            f"exported {result['exported']} finished jobs to {result['file']}; deleted {result['deleted']} "
            f"(finished before {render.format_time(before)}; goodput totals keep their figures)"
        )
    else:
        _print(
            f"deleted {result['deleted']} finished jobs (finished before {render.format_time(before)}; no export; "
            "goodput totals keep their figures)"
        )
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------------------------


def _default_db_url() -> str:
    env = os.environ.get("PHALANX_DB")
    if env:
        return env
    from phalanx.common.defaults import DEFAULT_DB_URL

    return DEFAULT_DB_URL


def build_parser() -> argparse.ArgumentParser:
    """Build the ``phalanx`` argument parser (subcommands set ``func``, which returns an exit code)."""
    parser = _Parser(prog="phalanx", description="Phalanx GPU-cluster control plane: jobs, nodes, database.")
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    parser.add_argument(
        "--scheduler",
        metavar="ADDR",
        default=None,
        help=f"scheduler host:port (default: $PHALANX_SCHEDULER, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"deadline of each call, retries included (default: {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--token", default=None, metavar="TOKEN", help="bearer token sent with every call (default: $PHALANX_TOKEN)"
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="reach the scheduler over TLS, trusting this CA (default: $PHALANX_TLS_CA)",
    )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="client certificate for mutual TLS (default: $PHALANX_TLS_CERT)"
    )
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="its private key (default: $PHALANX_TLS_KEY)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on standard error")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def json_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser(
        "submit",
        help="submit a gang job",
        usage="phalanx submit --name NAME --replicas R --gpus-per-replica G [options] -- CMD ARGS...",
    )
    p.add_argument("--name", required=True)
    p.add_argument("--replicas", type=_bounded("--replicas", 1), required=True, metavar="R")
    p.add_argument(
        "--gpus-per-replica",
        type=_bounded("--gpus-per-replica", 1),
        default=None,
        metavar="G",
        help="whole GPUs per replica (required, except with --mig or --gpu-milli, where it is 1)",
    )
    p.add_argument(
        "--priority",
        type=_priority,
        default=0,
        metavar="P",
        help="higher wins (default 0): an integer or a class name, "
        + ", ".join(f"{name} ({p})" for name, p in PRIORITY_CLASSES.items()),
    )
    p.add_argument(
        "--procs-per-replica",
        type=_bounded("--procs-per-replica", 0),
        default=0,
        metavar="K",
        help="0: one process per GPU (default); 1: one per replica",
    )
    p.add_argument("--env", action="extend", nargs="+", metavar="K=V", help="environment for the job (repeatable)")
    p.add_argument(
        "--required-tier",
        default=None,
        metavar="TIER",
        help="the gang must fit under one domain of this tier (node, a fabric tier such as leaf or "
        "spine, or cluster), or wait",
    )
    p.add_argument(
        "--preferred-tier",
        default=None,
        metavar="TIER",
        help="best effort: prefer placing the gang under one domain of this tier",
    )
    p.add_argument(
        "--mig",
        default=None,
        metavar="PROFILE",
        help="each replica is one MIG instance of this profile, e.g. 1g.10gb or 3g.40gb on H100 80GB",
    )
    p.add_argument(
        "--gpu-milli",
        type=_bounded("--gpu-milli", 1, 999),
        default=None,
        metavar="N",
        help="each replica is N thousandths of one GPU (1-999), shared through MPS",
    )
    p.add_argument(
        "--gpu-model",
        default=None,
        metavar="MODEL",
        help="only nodes whose GPU model contains MODEL (case-insensitive), e.g. H100",
    )
    p.add_argument(
        "--queue",
        default=None,
        metavar="QUEUE",
        help="the queue to submit to (its quota, cohort and fair share apply; default: default)",
    )
    p.add_argument(
        "--time-limit",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="declared runtime per attempt: seconds, 30m, 2h, 1d, H:MM:SS or D-HH:MM:SS; the gang is "
        "stopped at its limit, and a limit lets it backfill ahead of a waiting larger gang",
    )
    p.add_argument(
        "--max-restarts",
        type=_bounded("--max-restarts", 0),
        default=0,
        metavar="N",
        help="a rank exiting non-zero requeues the gang, to resume from its last committed checkpoint, "
        "up to N times instead of failing the job (default 0)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=_keep_checkpoints,
        default=None,
        metavar="K",
        help="the checkpoint coordinator keeps the job's newest K committed checkpoints and deletes the "
        "older ones (K >= 1; default: the coordinator's --keep-checkpoints, 3 unless set)",
    )
    p.add_argument(
        "--cpus-per-replica",
        type=_cpus,
        default=None,
        metavar="N",
        help="CPUs each replica reserves on its node with its GPUs, and is held to by a CPU quota (fractions "
        "allowed, e.g. 0.5; default: none reserved and no limit)",
    )
    p.add_argument(
        "--memory-per-replica",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="memory each replica reserves on its node and is limited to, e.g. 512M or 64G (binary units); a rank "
        "past it is killed and the job says 'out of memory (limit SIZE)' (default: none reserved and no limit)",
    )
    for flag in RESERVED_SUBMIT_FLAGS:
        p.add_argument(flag, nargs="?", const="", default=None, metavar="VALUE", help="reserved: not supported yet")
    json_flag(p)
    p.add_argument("command", nargs="*", metavar="CMD", help="the command, after --")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="list jobs, newest first (finished ones included), a page at a time")
    p.add_argument(
        "--state",
        action="extend",
        nargs="+",
        metavar="STATE",
        help="only these states: " + ", ".join(s.value for s in JobState if s.value != "UNSPECIFIED"),
    )
    p.add_argument(
        "--limit", type=int, default=None, metavar="N", help=f"jobs per page, 1 to {JOBS_PAGE_MAX} (default 100)"
    )
    p.add_argument(
        "--page-token",
        default=None,
        metavar="T",
        help="print the page that a previous page's 'next page:' line (or next_page_token) names",
    )
    p.add_argument("--all", action="store_true", help="every page, each printed as it arrives (not with --limit)")
    json_flag(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="show one job")
    p.add_argument("job_id", metavar="ID")
    json_flag(p)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id", metavar="ID")
    json_flag(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("checkpoint", help="ask a running job to checkpoint now")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--reason", default=None, metavar="TEXT", help="why, for the record (default: user)")
    json_flag(p)
    p.set_defaults(func=cmd_checkpoint)

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
    json_flag(p)
    p.set_defaults(func=cmd_goodput)

    p = sub.add_parser("nodes", help="list nodes")
    json_flag(p)
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
    p.add_argument("--port", type=_bounded("--port", 0, 65535), default=8080, metavar="P", help="default 8080")
    p.add_argument(
        "--checkpoint-coordinator",
        default=os.environ.get("PHALANX_CHECKPOINT_ADDR") or None,
        metavar="ADDR",
        help="the checkpoint coordinator, for the checkpoints on a job's page (env PHALANX_CHECKPOINT_ADDR)",
    )
    p.set_defaults(func=cmd_web)

    p = sub.add_parser("logs", help="a job's rank logs (stdout and stderr), from the ranks' nodes")
    p.add_argument("job_id", metavar="JOB")
    p.add_argument("--rank", type=_bounded("--rank", 0), default=None, metavar="R", help="one rank (default: all)")
    p.add_argument(
        "--attempt", type=_bounded("--attempt", 1), default=0, metavar="A", help="an attempt (default: the last)"
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what the ranks write until they end")
    p.add_argument("--tail", type=_bounded("--tail", 1), default=0, metavar="N", help="only each rank's last N lines")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("node", help="node administration (admin): drain, undrain")
    node_sub = p.add_subparsers(dest="node_command", metavar="SUBCOMMAND", parser_class=_Parser)
    node_sub.required = True
    dr = node_sub.add_parser("drain", help="take a node out of placement (stays drained across agent restarts)")
    dr.add_argument("node_name", metavar="NAME")
    dr.add_argument("--reason", default=None, metavar="TEXT", help="why, shown as the node's message")
    json_flag(dr)
    dr.set_defaults(func=cmd_node_drain)
    un = node_sub.add_parser("undrain", help="put a drained node back (READY if its agent is alive)")
    un.add_argument("node_name", metavar="NAME")
    json_flag(un)
    un.set_defaults(func=cmd_node_undrain)

    p = sub.add_parser("queue", help="queues: quotas, usage, fair share, pending jobs in serving order")
    p.add_argument("name", nargs="?", default="", metavar="QUEUE")
    json_flag(p)
    p.set_defaults(func=cmd_queue)

    p = sub.add_parser("quota", help="queue quotas (admin): set, delete")
    q_sub = p.add_subparsers(dest="quota_command", metavar="SUBCOMMAND", parser_class=_Parser)
    q_sub.required = True
    qs = q_sub.add_parser("set", help="create or replace a queue's quotas, cohort, weight and tenants")
    qs.add_argument("queue", metavar="QUEUE")
    qs.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="FLAVOR=GPUS[,borrow=N][,mig=N]",
        help="nominal GPUs of a flavor (a GPU model such as H100, or '*' for any), optionally a "
        "borrowing limit and MIG compute slices; repeat for several flavors, in preference order",
    )
    qs.add_argument("--gpus", type=float, default=None, metavar="N", help="shorthand for --quota '*=N'")
    qs.add_argument("--cohort", default="", metavar="C", help="queues of one cohort lend each other idle quota")
    qs.add_argument("--weight", type=float, default=1.0, metavar="W", help="fair-share weight (default 1)")
    qs.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="T",
        help="a tenant allowed to submit to it (repeat; default: anyone)",
    )
    qs.add_argument(
        "--max-priority",
        type=_priority,
        default=0,
        metavar="P",
        help="the highest priority its jobs may ask for unless an admin submits them: an integer or a class "
        "(best-effort, batch, default, high, critical); default 0 (default), so high and critical must be granted",
    )
    json_flag(qs)
    qs.set_defaults(func=cmd_quota_set)
    qd = q_sub.add_parser("delete", help="remove a queue (refused while it has pending or running jobs)")
    qd.add_argument("queue", metavar="QUEUE")
    json_flag(qd)
    qd.set_defaults(func=cmd_quota_delete)

    p = sub.add_parser("token", help="authentication tokens")
    tok_sub = p.add_subparsers(dest="token_command", metavar="SUBCOMMAND", parser_class=_Parser)
    tok_sub.required = True
    tn = tok_sub.add_parser("new", help="print a new token and its tokens-file entry")
    tn.add_argument("--tenant", required=True, metavar="T", help="the tenant the token acts for")
    tn.add_argument(
        "--role",
        default="user",
        choices=["user", "admin", "node", "service"],
        help="user (its tenant's jobs), admin (every job, node drain), node (agents), service "
        "(cluster processes and ranks: the checkpoint coordinator); default user",
    )
    tn.add_argument(
        "--node",
        default=None,
        metavar="NAME",
        help="with --role node (required there): the one node the token may register, heartbeat and report as",
    )
    json_flag(tn)
    tn.set_defaults(func=cmd_token_new)

    p = sub.add_parser("db", help="database administration")
    db_sub = p.add_subparsers(dest="db_command", metavar="SUBCOMMAND", parser_class=_Parser)
    db_sub.required = True
    up = db_sub.add_parser("upgrade", help="apply the migrations (creates a SQLite file if needed)")
    up.add_argument(
        "--db", default=None, metavar="URL", help="database URL (default: $PHALANX_DB, else the local SQLite file)"
    )
    json_flag(up)
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
    json_flag(pr)
    pr.set_defaults(func=cmd_db_prune)

    try:  # POSIX only (fcntl, process groups)
        from . import cluster, demo
    except ImportError:
        pass
    else:
        cluster.register(sub)
        demo.register(sub)
    from . import place, sim

    place.register(sub)
    sim.register(sub)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split ``... submit ... -- CMD ARGS`` at the first ``--``, so that CMD may contain anything."""
    if "--" not in argv:
        return argv, None
    idx = argv.index("--")
    if "submit" not in argv[:idx]:
        return argv, None
    return argv[:idx], argv[idx + 1 :]


def _error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The exit code: 0 success, 1 error, 2 usage error, 130 interrupted.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    args_list, command = _split_command(args_list)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if command is not None:
        if getattr(args, "command", None):
            _error("give the command after -- only")
            return EXIT_USAGE
        args.command = command
    if getattr(args, "func", None) in (cmd_db_upgrade, cmd_db_prune) and args.db is None:
        args.db = _default_db_url()
    if args.verbose:
        from phalanx.common.logging import configure_logging

        configure_logging("phalanx-cli", "DEBUG").debug("cli", argv=args_list, scheduler=args.scheduler)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args) or 0)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except RPCError as exc:
        _error(f"{exc.code_name}: {exc.message}")
        return EXIT_ERROR
    except PhalanxError as exc:
        _error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `phalanx jobs | head`); nothing more to say.
        try:
            sys.stdout = open(os.devnull, "w")  # silence the flush at exit
        except OSError:
            pass
        return EXIT_ERROR
    except Exception as exc:  # e.g. a database error in `db upgrade`: one line, no traceback
        if args.verbose:
            raise
        _error(f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
