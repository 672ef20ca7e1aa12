"""``phalanx sim failures``: the four recovery policies (requeue, spares, elastic, spares+elastic) on the same
workload and the same failure draws; a table, ``failures.json``, ``failures.md`` and a plot in ``--out``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import UsageError


def failure_rate(text: str) -> float:
    """``--failures``: llama3, llama3xN, none or a rate per GPU-day, as a usage error when bad."""
    from phalanx.sim.failures import parse_failure_rate

    try:
        return parse_failure_rate(text)
    except ValueError as exc:
        raise UsageError(f"--failures: {exc}") from None


def cmd_sim_failures(args: argparse.Namespace) -> int:
    from phalanx.core.recovery import RestartCosts
    from phalanx.sim.failure_eval import FailureEval, markdown, run_eval, write_outputs
    from phalanx.sim.report import plots_unavailable
    from phalanx.sim.traces import DataNotFound

    try:
        costs = RestartCosts(args.checkpoint_interval * 60.0, args.warm_restart, args.cold_start)
    except ValueError as exc:
        raise UsageError(f"--checkpoint-interval/--warm-restart/--cold-start: {exc}") from None
    ev = FailureEval(
        cluster=args.cluster,
        large=args.large,
        large_nodes=args.large_nodes,
        large_days=args.large_days,
        background=args.background,
        load=args.load,
        max_job_hours=args.max_job_hours,
        min_job_hours=args.min_job_hours,
        trace=args.trace or "",
        failures_per_gpu_day=failure_rate(args.failures),
        repair_hours=args.repair_hours,
        costs=costs,
        spares_per_domain=args.spares,
        large_threshold=args.large_threshold,
        elastic_min=args.elastic_min,
        seed=args.seed,
        policies=tuple(p.strip() for p in args.policy.split(",") if p.strip()),
        data=args.data,
    )
    problems = ev.problems()
    if problems:
        raise UsageError("; ".join(problems))
    missing = plots_unavailable()
    if missing:
        sys.stderr.write(f"[sim] warning: no plot will be drawn: {missing}\n")

    def progress(line: str) -> None:
        sys.stderr.write(f"[sim] {line}\n")
        sys.stderr.flush()

    try:
        doc = run_eval(ev, progress)
    except DataNotFound as exc:
        sys.stderr.write(f"error: {exc}\n(or run without the data: --background synthetic)\n")
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    written = write_outputs(doc, Path(args.out))
    sys.stderr.write(f"[sim] {doc['source']}; wrote {', '.join(str(Path(args.out) / w) for w in written)}\n")
    if args.json:
        print(json.dumps(doc, default=float))
    else:
        sys.stdout.write(markdown(doc) + "\n")
    return 0


def add_failures(sub) -> None:
    """``phalanx sim failures``."""
    from phalanx.core.recovery import POLICIES

    p = sub.add_parser(
        "failures",
        help="node failures at a published rate and four recovery policies (requeue, spares in the domain, elastic "
        "shrink, spares+elastic) on the same workload and failures: ETTR, goodput, spare GPU-hours, JCT",
    )
    p.add_argument(
        "--cluster",
        default="576x8,leaf=18,spine=8",
        metavar="SPEC",
        help="NODESxGPUS[,leaf=N][,spine=N]; a leaf is a spare domain (default 576x8,leaf=18,spine=8: 32 domains)",
    )
    p.add_argument("--large", type=int, default=4, metavar="N", help="pre-training gangs (default 4)")
    p.add_argument("--large-nodes", type=int, default=112, metavar="N", help="nodes per gang (default 112)")
    p.add_argument("--large-days", type=float, default=14.0, metavar="D", help="days of work per gang (default 14)")
    p.add_argument(
        "--background",
        choices=["auto", "philly", "synthetic"],
        default="auto",
        help="the jobs around the gangs: resampled from the Philly-derived trace (auto: when the data is found), "
        "or a synthetic Philly-like mix (no data needed)",
    )
    p.add_argument("--load", type=float, default=1.0, metavar="L", help="background load on the rest (default 1.0)")
    p.add_argument("--max-job-hours", type=float, default=8.0, metavar="H", help="background durations capped at H")
    p.add_argument(
        "--min-job-hours", type=float, default=0.5, metavar="H", help="background jobs shorter than H left out"
    )
    p.add_argument("--trace", default="", metavar="SPEC", help="replay this `sim run` trace as is instead (e.g. mix)")
    p.add_argument(
        "--failures",
        default="llama3",
        metavar="llama3|llama3xN|none|RATE",
        help="node failures per GPU-day: llama3 (default; 419 interruptions in 54 days on 16,384 GPUs, Dubey et "
        "al. 2024, section 3.3.4: 4.74e-4), N times that, none, or a number",
    )
    p.add_argument(
        "--repair-hours", type=float, default=4.0, metavar="H", help="mean repair time, exponential (default 4)"
    )
    p.add_argument("--checkpoint-interval", type=float, default=30.0, metavar="MIN", help="minutes (default 30)")
    p.add_argument("--warm-restart", type=float, default=300.0, metavar="S", help="swap/shrink restart (default 300)")
    p.add_argument("--cold-start", type=float, default=900.0, metavar="S", help="requeue's cold start (default 900)")
    p.add_argument("--spares", type=int, default=1, metavar="K", help="spare nodes per domain of a large gang (1)")
    p.add_argument(
        "--large-threshold",
        type=int,
        default=8,
        metavar="N",
        help="a gang of at least N whole nodes is large: it gets spares, is elastic, and counts in ETTR (default 8)",
    )
    p.add_argument(
        "--elastic-min", type=float, default=0.75, metavar="F", help="elastic MIN as a share of the size (0.75)"
    )
    p.add_argument(
        "--policy", default=",".join(POLICIES), metavar="NAME[,NAME...]", help=f"default all: {', '.join(POLICIES)}"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the failures and the background jobs (default 0)")
    p.add_argument(
        "--data", default=None, metavar="DIR", help="the data folder (default: $PHALANX_DATA, then ../shared/data)"
    )
    p.add_argument("--out", default="sim-failures", metavar="DIR", help="where the report goes (./sim-failures)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON document, not the table")
    p.set_defaults(func=cmd_sim_failures)
