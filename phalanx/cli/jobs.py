"""The job verbs of ``phalanx``: ``submit``, ``jobs`` (a page or every page), ``job``, ``cancel`` and ``checkpoint``,
their flags and their handlers.
"""

from __future__ import annotations

import argparse
import sys

from phalanx.client import Client, JobState
from phalanx.core.preemption import PRIORITY_CLASSES

from . import console, render
from .argtypes import (
    bounded,
    cpus,
    duration,
    keep_checkpoints,
    memory,
    parse_env,
    parse_states,
    priority,
    replicas,
)
from .common import EXIT_OK, UsageError, add_json_flag
from .graph_flags import add_graph_flags, graph_kwargs
from .graph_render import group_arrays

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
    env = parse_env(args.env)
    min_replicas, max_replicas = args.replicas
    graph = graph_kwargs(args)  # --after, --array
    with console.client(args) as client:
        job = client.submit(
            args.name,
            max_replicas,
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
            segment=args.segment or 0,
            segment_tier=args.segment_tier or "",
            spares_per_segment=args.spares_per_segment or 0,
            min_replicas=min_replicas,
            **graph,
        )
    console.show_job(job, args.json)
    return EXIT_OK


JOBS_PAGE_MAX = 1000  # the scheduler's largest ListJobs page (services/scheduler/paging.py)


ALL_PAGE_SIZE = 1000  # `phalanx jobs --all` asks for pages this large


def cmd_jobs(args: argparse.Namespace) -> int:
    """``phalanx jobs``: one page of jobs, newest first (the newest 100, ``--limit N`` of them, ``--page-token T``
    the page a previous one named), or every page (``--all``, printed as each arrives). The table ends with
    ``next page: phalanx jobs ... --page-token T`` when more follow; ``--json`` prints one object
    ``{"jobs": [...], "next_page_token": "..."}`` ("" on the last page, and with ``--all``)."""
    states = parse_states(args.state)
    if args.all and args.limit is not None:
        raise UsageError("--limit and --all cannot be used together: --all lists every page")
    if args.limit is not None and not 1 <= args.limit <= JOBS_PAGE_MAX:
        raise UsageError(f"--limit must be 1 to {JOBS_PAGE_MAX}, got {args.limit}")
    token = args.page_token or ""
    with console.client(args) as client:
        if args.all:
            return _all_jobs(client, states, token, args.json, args.expand)
        jobs, token = client.list_jobs_page(states or None, page_size=args.limit or 0, page_token=token)
    if args.json:
        console.emit(render.to_json({"jobs": [j.to_dict() for j in jobs], "next_page_token": token}))
        return EXIT_OK
    console.emit(render.jobs_table(group_arrays(jobs, args.expand)))
    if token:
        command = ["phalanx", "jobs"]
        if states:
            command += ["--state", *dict.fromkeys(s.value for s in states)]
        if args.limit is not None:
            command += ["--limit", str(args.limit)]
        console.emit(render.next_page_hint(" ".join(command), token))
    return EXIT_OK


def _all_jobs(client: Client, states: list[JobState], token: str, as_json: bool, expand: bool = False) -> int:
    """``phalanx jobs --all``: follow every page from `token`, printing each page as it arrives (an error midway
    leaves the pages printed so far, and exits 1)."""

    def pages():
        nonlocal token
        while True:
            jobs, token = client.list_jobs_page(states or None, page_size=ALL_PAGE_SIZE, page_token=token)
            yield jobs
            if not token:
                return

    out = console.out()
    if as_json:
        for chunk in render.jobs_json_stream(pages()):
            out.write(chunk)
            out.flush()
        return EXIT_OK
    table = render.JobsTableStream()
    for jobs in pages():
        text = table.page(group_arrays(jobs, expand))
        if text:
            console.emit(text)
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    """``phalanx job ID``: one job."""
    with console.client(args) as client:
        job = client.get_job(args.job_id)
    console.show_job(job, args.json)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """``phalanx cancel ID``: cancel a job and print it."""
    with console.client(args) as client:
        before = client.get_job(args.job_id)
        job = client.cancel(args.job_id)
    console.show_job(job, args.json)
    if before.state.value in ("SUCCEEDED", "FAILED", "CANCELLED"):
        sys.stderr.write(f"note: job {job.id} had already finished ({before.state.value}); cancel changed nothing\n")
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``phalanx checkpoint ID``: ask a running job to checkpoint now; print the outstanding request."""
    reason = args.reason if args.reason is not None else "user"
    if not reason.strip():
        raise UsageError("--reason must not be empty")
    with console.client(args) as client:
        result = client.checkpoint(args.job_id, reason=reason)
    console.emit(render.to_json(result.to_dict()) if args.json else render.checkpoint_result(result, asked=reason))
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------------------------------


def register(sub) -> None:
    """Add ``submit``, ``jobs``, ``job``, ``cancel`` and ``checkpoint`` to the ``phalanx`` subcommands `sub`."""
    _add_submit(sub)

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
    p.add_argument(
        "--expand",
        action="store_true",
        help="list an array's tasks too (by default an array is one line with its tasks' progress; --json lists "
        "every job)",
    )
    add_json_flag(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="show one job")
    p.add_argument("job_id", metavar="ID")
    add_json_flag(p)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id", metavar="ID")
    add_json_flag(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("checkpoint", help="ask a running job to checkpoint now")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--reason", default=None, metavar="TEXT", help="why, for the record (default: user)")
    add_json_flag(p)
    p.set_defaults(func=cmd_checkpoint)


def _add_submit(sub) -> None:
    """``phalanx submit``: the gang's shape, its placement constraints, its life (time limit, restarts,
    checkpoints) and the host resources of each replica."""
    p = sub.add_parser(
        "submit",
        help="submit a gang job",
        usage="phalanx submit --name NAME --replicas R --gpus-per-replica G [options] -- CMD ARGS...",
    )
    p.add_argument("--name", required=True)
    p.add_argument(
        "--replicas",
        type=replicas,
        required=True,
        metavar="R",
        help="replicas (nodes) of the gang: N, or MIN:MAX for an elastic gang that starts once MIN fit, grows "
        "towards MAX as capacity frees and shrinks (not below MIN) when a node is lost",
    )
    p.add_argument(
        "--gpus-per-replica",
        type=bounded("--gpus-per-replica", 1),
        default=None,
        metavar="G",
        help="whole GPUs per replica (required, except with --mig or --gpu-milli, where it is 1)",
    )
    p.add_argument(
        "--priority",
        type=priority,
        default=0,
        metavar="P",
        help="higher wins (default 0): an integer or a class name, "
        + ", ".join(f"{name} ({p})" for name, p in PRIORITY_CLASSES.items()),
    )
    p.add_argument(
        "--procs-per-replica",
        type=bounded("--procs-per-replica", 0),
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
        type=bounded("--gpu-milli", 1, 999),
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
        "--segment",
        type=bounded("--segment", 1),
        default=None,
        metavar="S",
        help="a multi-level gang of replicas/S segments of S replicas, each wholly inside one domain of "
        "--segment-tier, on as few higher-tier domains as possible, a segment's ranks contiguous (S divides --replicas)",
    )
    p.add_argument(
        "--segment-tier",
        default=None,
        metavar="TIER",
        help="the tier each segment lies in (default: the NVLink domain where the fabric has one, else the leaf)",
    )
    p.add_argument(
        "--spares-per-segment",
        type=bounded("--spares-per-segment", 0),
        default=None,
        metavar="K",
        help="keep K spare replicas idle in each segment's domain, reserved with the gang and charged to its queue; a "
        "lost node (or failed GPU) of the gang is swapped for one and the gang restarts there from its checkpoint "
        "(needs --segment)",
    )
    p.add_argument(
        "--queue",
        default=None,
        metavar="QUEUE",
        help="the queue to submit to (its quota, cohort and fair share apply; default: default)",
    )
    _add_submit_life(p)
    add_graph_flags(p)
    for flag in RESERVED_SUBMIT_FLAGS:
        p.add_argument(flag, nargs="?", const="", default=None, metavar="VALUE", help="reserved: not supported yet")
    add_json_flag(p)
    p.add_argument("command", nargs="*", metavar="CMD", help="the command, after --")
    p.set_defaults(func=cmd_submit)


def _add_submit_life(p: argparse.ArgumentParser) -> None:
    """The flags of ``phalanx submit`` about an attempt's life (time limit, restarts, checkpoints kept) and the host
    resources each replica reserves."""
    p.add_argument(
        "--time-limit",
        type=duration,
        default=None,
        metavar="DURATION",
        help="declared runtime per attempt: seconds, 30m, 2h, 1d, H:MM:SS or D-HH:MM:SS; the gang is "
        "stopped at its limit, and a limit lets it backfill ahead of a waiting larger gang",
    )
    p.add_argument(
        "--max-restarts",
        type=bounded("--max-restarts", 0),
        default=0,
        metavar="N",
        help="a rank exiting non-zero requeues the gang, to resume from its last committed checkpoint, "
        "up to N times instead of failing the job (default 0)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=keep_checkpoints,
        default=None,
        metavar="K",
        help="the checkpoint coordinator keeps the job's newest K committed checkpoints and deletes the "
        "older ones (K >= 1; default: the coordinator's --keep-checkpoints, 3 unless set)",
    )
    p.add_argument(
        "--cpus-per-replica",
        type=cpus,
        default=None,
        metavar="N",
        help="CPUs each replica reserves on its node with its GPUs, and is held to by a CPU quota (fractions "
        "allowed, e.g. 0.5; default: none reserved and no limit)",
    )
    p.add_argument(
        "--memory-per-replica",
        type=memory,
        default=None,
        metavar="SIZE",
        help="memory each replica reserves on its node and is limited to, e.g. 512M or 64G (binary units); a rank "
        "past it is killed and the job says 'out of memory (limit SIZE)' (default: none reserved and no limit)",
    )
