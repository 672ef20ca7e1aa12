"""``phalanx sim run``: replay a real trace through the scheduler's core under one or more policies, and write a
report (``result.json``, ``report.md``, PNG plots) to ``--out``. The plots need matplotlib (``pip install
'phalanx[plots]'``); without it the run warns at its start and writes the report without them (exit 0)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .common import UsageError
from .sim_failures import failure_rate


def cmd_sim_run(args: argparse.Namespace) -> int:
    from phalanx.sim.engine import POLICIES, ClusterSpec, equal_quotas, simulate
    from phalanx.sim.network import NetworkSpec
    from phalanx.sim.report import plots_unavailable, write_report
    from phalanx.sim.traces import DataNotFound, TraceJob, find_data, load_trace

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise UsageError(
            f"--policy: unknown {', '.join(unknown) or '(none)'}; policies: {', '.join(POLICIES)} "
            "(comma-separated to compare several)"
        )
    try:
        cluster = ClusterSpec.parse(args.cluster)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    failures = failure_rate(args.failures)
    if not args.repair_hours > 0:
        raise UsageError("--repair-hours must be > 0")
    if not args.min_runtime >= 0:
        raise UsageError("--min-runtime must be >= 0 (seconds)")
    try:
        data = find_data(args.data)
        jobs: list[TraceJob] = load_trace(args.trace, data)  # a Trace; the cuts below make plain lists
    except DataNotFound as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except ValueError as exc:
        raise UsageError(f"--trace: {exc}") from None
    if args.limit:
        jobs = jobs[: args.limit]
    if not args.arrival_scale > 0:
        raise UsageError("--arrival-scale must be > 0")
    if args.arrival_scale != 1.0:
        jobs = [dataclasses.replace(j, submit_s=j.submit_s * args.arrival_scale) for j in jobs]
    too_big = [
        j
        for j in jobs
        if j.gpus_per_replica > cluster.gpus or j.replicas * j.gpus_per_replica > cluster.nodes * cluster.gpus
    ]
    jobs = [j for j in jobs if j not in too_big]
    sys.stderr.write(
        f"[sim] {len(jobs)} jobs from {args.trace} ({len(too_big)} larger than the cluster left out) "
        f"on {cluster.nodes} x {cluster.gpus} GPUs\n"
    )
    missing = plots_unavailable()  # plots are optional (the `plots` extra): say so now, not after the run
    if missing:
        sys.stderr.write(f"[sim] warning: the report will have no plots: {missing}\n")
    results = []
    # Progress over the trace: a bar per policy on a terminal (rich), else a line at each report.
    bars = None
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bars = Progress(
            TextColumn("[sim] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("jobs"),
            TimeRemainingColumn(),
            console=Console(file=sys.stderr),
        )
        bars.start()
    for policy in policies:
        task = bars.add_task(str(policy), total=len(jobs)) if bars is not None else None

        def progress(done: int, total: int, policy=policy, task=task) -> None:
            if bars is not None and task is not None:
                bars.update(task, completed=done, total=total)
                return
            sys.stderr.write(f"[sim] {policy}: {done}/{total} jobs done\n")
            sys.stderr.flush()

        network = None if args.no_network else NetworkSpec(oversubscription=cluster.oversub)
        quotas = equal_quotas(jobs, cluster.nodes * cluster.gpus) if args.quotas == "equal" else None
        result = simulate(
            jobs,
            cluster,
            policy,
            failures_per_gpu_day=failures,
            repair_s=args.repair_hours * 3600.0,
            checkpoint=args.checkpoint,
            seed=args.seed,
            progress=progress,
            network=network,
            quotas=quotas,
            min_runtime_s=args.min_runtime,
            borrower_preempts=args.borrower_preemption,
        )
        m = result.metrics
        sys.stderr.write(
            f"[sim] {policy}: {m['completed']}/{m['jobs']} completed, utilisation "
            f"{m['utilization_allocated']:.1%}, mean JCT {m['jct_mean_h']:.2f} h, "
            f"{m['preemptions']} preemptions, {m['events_per_s']:.0f} events/s\n"
        )
        results.append(result)
    if bars is not None:
        bars.stop()
    doc = write_report(results, Path(args.out), f"Phalanx simulation: {args.trace} on {args.cluster}")
    sys.stderr.write(f"[sim] report in {Path(args.out) / 'report.md'}\n")
    print(json.dumps({"trace": args.trace, "cluster": args.cluster, "policies": doc}, default=float))
    return 0


def _int_range(text: str) -> list[int]:
    """ "42-51" or "42,43,50" -> the seeds."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give seeds as 42-51 or 42,43,50") from None
    if not out:
        raise argparse.ArgumentTypeError("no seeds given")
    return out


def cmd_sim_fgd(args: argparse.Namespace) -> int:
    from phalanx.core.packing import POLICIES
    from phalanx.sim.fgd import TASK_LISTS, run_experiment
    from phalanx.sim.traces import DataNotFound

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UsageError(f"--policies: unknown {', '.join(bad) or '(none)'}; policies: {', '.join(POLICIES)}")
    lists = [n.strip() for n in args.lists.split(",") if n.strip()] if args.lists else list(TASK_LISTS)
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")

    def progress(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        doc = run_experiment(
            args.data,
            Path(args.out),
            policies=policies,
            task_lists=lists,
            seeds=args.seeds,
            jobs=args.jobs,
            progress=progress,
        )
    except DataNotFound as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stderr.write(
        f"[fgd] {Path(args.out) / 'fgd.json'}, {Path(args.out) / 'fgd_report.md'} written in {doc['wall_s']:.0f} s\n"
    )
    print(json.dumps({k: doc[k] for k in ("mean_alloc_130", "fidelity_diff_points", "fidelity_ok", "wall_s")}))
    return 0


def cmd_sim_serving(args: argparse.Namespace) -> int:
    from phalanx.sim.report import plots_unavailable
    from phalanx.sim.serving_eval import ServingEval, markdown, run_eval, write_outputs
    from phalanx.sim.traces import DataNotFound

    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    ev = ServingEval(
        nodes=args.nodes,
        hours=args.hours,
        seed=args.seed,
        serving_share=args.serving_share,
        peak_to_trough=args.peak_trough,
        arrival_cv=args.arrival_cv,
        training_load=args.training_load,
        trace=args.trace,
        min_runtime_s=args.min_runtime,
        startup_s=args.startup,
        policies=policies,
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
        doc, results, _ = run_eval(ev, args.data, progress)
    except DataNotFound as exc:
        sys.stderr.write(f"error: {exc}\n(or run on the synthetic training mix: --trace synthetic)\n")
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    written = write_outputs(doc, results, Path(args.out))
    sys.stderr.write(f"[sim] wrote {', '.join(str(p) for p in written)}\n")
    if args.json:
        print(json.dumps(doc, default=float))
    else:
        sys.stdout.write(markdown(doc))
    return 0


def register(subparsers) -> None:
    """Add ``sim run``, ``sim fgd``, ``sim serving`` and ``sim failures`` to the ``phalanx`` subcommands."""
    from .sim_failures import add_failures

    p = subparsers.add_parser("sim", help="trace-driven simulation through the scheduler's core")
    sub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", parser_class=type(p))
    sub.required = True
    _add_run(sub)
    _add_fgd(sub)
    _add_serving(sub)
    add_failures(sub)


def _add_run(sub) -> None:
    """``phalanx sim run``."""
    from phalanx.sim.engine import POLICIES

    run = sub.add_parser("run", help="replay a trace under one or more policies and write a report")
    run.add_argument(
        "--trace",
        required=True,
        metavar="SPEC",
        help="philly, philly:team=ID, alibaba:default, pollux:workload-1, csv:PATH, or the "
        "multi-tenant mix: mix[:teams=N,jobs=J,hours=H,pretrain=K,finetune=M,seed=S] (N Philly "
        "teams' first J jobs each over H hours, plus K high-priority 64-256-GPU pre-training gangs "
        "and M low-priority 1-8-GPU or fractional fine-tuning jobs spread across the teams; "
        "defaults 4,300,168,8,2000,0; use with --quotas equal)",
    )
    run.add_argument(
        "--cluster",
        default="512x8,leaf=32,spine=16",
        metavar="SPEC",
        help="NODESxGPUS[,leaf=N][,spine=N][,oversub=R] (default 512x8,leaf=32,spine=16; oversub: "
        "leaf-to-spine oversubscription of the network model, 1 = non-blocking)",
    )
    run.add_argument(
        "--policy",
        default="gang-fifo,gang-backfill,topo",
        metavar="NAME[,NAME...]",
        help=f"policies to compare: {', '.join(POLICIES)} (a: per-pod, b: gang FIFO, c: + EASY "
        "backfill, d: + topology, e: + preemption with checkpoint-restart, f: + fractional GPUs)",
    )
    run.add_argument(
        "--failures",
        default="none",
        metavar="llama3|llama3xN|none|RATE",
        help="node failures per GPU-day: llama3 (419 interruptions in 54 days on 16,384 GPUs, Dubey et al. 2024, "
        "section 3.3.4: 4.74e-4), N times that, none (default), or a number",
    )
    run.add_argument(
        "--repair-hours",
        type=float,
        default=1.0,
        metavar="H",
        help="how long a failed node stays down (default 1)",
    )
    run.add_argument(
        "--checkpoint",
        choices=["young-daly", "none"],
        default="young-daly",
        help="on a failure, restart from the last Young/Daly checkpoint or from scratch",
    )
    run.add_argument(
        "--data", default=None, metavar="DIR", help="the data folder (default: $PHALANX_DATA, then ../shared/data)"
    )
    run.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N jobs of the trace")
    run.add_argument(
        "--quotas",
        choices=["none", "equal"],
        default="none",
        help="equal: each tenant of the trace (a Philly team) gets a queue with an equal share of the "
        "cluster as its quota, in one cohort (borrowing idle quota), and fair share across them",
    )
    run.add_argument(
        "--no-network",
        action="store_true",
        help="run times as in the trace (no AllReduce model: placement does not change speed)",
    )
    run.add_argument(
        "--arrival-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply submit times by S (0.1: arrivals ten times as dense, to load a large cluster)",
    )
    run.add_argument(
        "--min-runtime",
        type=float,
        default=600.0,
        metavar="S",
        help="preemption (topo-preempt, topo-mig): a gang cannot be preempted in its first S seconds (default 600)",
    )
    run.add_argument(
        "--borrower-preemption",
        action="store_true",
        help="with --quotas: let a gang that would run on borrowed quota preempt other queues' "
        "lower-priority gangs (by default it preempts only within its own queue, as the scheduler "
        "does: Kueue's borrowWithinCohort: Never; this flag shows the thrashing that avoids)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", required=True, metavar="DIR", help="where result.json, report.md and plots go")
    run.set_defaults(func=cmd_sim_run)


def _add_fgd(sub) -> None:
    """``phalanx sim fgd``."""
    fgd = sub.add_parser(
        "fgd",
        help="the FGD paper's experiment (ATC'23): online packing of the Alibaba v2023 task "
        "lists at 130%% load, BestFit and FGD reproduced against Phalanx's packer",
    )
    fgd.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="where fgd.json (task list -> Phalanx's mean allocation %% at 130%% load), "
        "fgd_runs.json and fgd_report.md go",
    )
    fgd.add_argument(
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        metavar="N",
        help="runs in parallel (default: the CPUs this process may use)",
    )
    fgd.add_argument(
        "--policies",
        default="bestfit,fgd,phalanx",
        metavar="P[,P...]",
        help="bestfit, fgd (the paper's, reproduced), phalanx (default: all three)",
    )
    fgd.add_argument(
        "--lists",
        default="",
        metavar="NAME[,NAME...]",
        help="task lists (default: the 17 of the paper's figures: default, cpu050 ... multigpu50)",
    )
    fgd.add_argument(
        "--seeds",
        type=_int_range,
        default=list(range(42, 52)),
        metavar="A-B",
        help="shuffle seeds (default 42-51, as the paper)",
    )
    fgd.add_argument(
        "--data", default=None, metavar="DIR", help="the data folder (default: $PHALANX_DATA, then ../shared/data)"
    )
    fgd.set_defaults(func=cmd_sim_fgd)


def _add_serving(sub) -> None:
    """``phalanx sim serving``."""
    from phalanx.sim.serving import SERVING_POLICIES
    from phalanx.sim.serving_load import AZURE_CONVERSATION_PEAK_TO_TROUGH, DEFAULT_ARRIVAL_CV

    p = sub.add_parser(
        "serving",
        help="an autoscaled LLM-serving fleet next to a training trace under three policies (static split, "
        "preemption, preemption with checkpoints and backfill): a table, JSON and a plot",
    )
    p.add_argument("--hours", type=float, default=72.0, metavar="H", help="the window replayed (default 72)")
    p.add_argument("--nodes", type=int, default=64, metavar="N", help="nodes of 8 GPUs, leaves of 8 (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seeds the load and the training jobs (default 0)")
    p.add_argument(
        "--out",
        default="sim-serving",
        metavar="DIR",
        help="where serving.md, serving.json and serving.png go (default ./sim-serving)",
    )
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON document, not the table")
    p.add_argument(
        "--trace",
        default="philly",
        metavar="SPEC",
        help="where the training jobs are resampled from: a `sim run --trace` spec (default philly), or "
        "synthetic (a Philly-like mix, no data needed)",
    )
    p.add_argument(
        "--data", default=None, metavar="DIR", help="the data folder (default: $PHALANX_DATA, then ../shared/data)"
    )
    p.add_argument(
        "--policy",
        default=",".join(SERVING_POLICIES),
        metavar="NAME[,NAME...]",
        help=f"policies to compare (default all: {', '.join(SERVING_POLICIES)})",
    )
    p.add_argument(
        "--serving-share",
        type=float,
        default=0.4,
        metavar="F",
        help="the share of the nodes the fleet wants at the load's daily peak (default 0.4)",
    )
    p.add_argument(
        "--peak-trough",
        type=float,
        default=AZURE_CONVERSATION_PEAK_TO_TROUGH,
        metavar="R",
        help="the load's daily peak over its trough (default %(default)g: the Azure 2024 conversation trace; "
        "its coding trace: about 10)",
    )
    p.add_argument(
        "--arrival-cv",
        type=float,
        default=DEFAULT_ARRIVAL_CV,
        metavar="C",
        help="coefficient of variation of the Gamma inter-arrival times (1: Poisson; default %(default)g)",
    )
    p.add_argument(
        "--training-load",
        type=float,
        default=1.0,
        metavar="L",
        help="training offered as a share of the GPUs serving leaves on average (default 1.0)",
    )
    p.add_argument(
        "--min-runtime",
        type=float,
        default=0.0,
        metavar="S",
        help="a training gang cannot be preempted in its first S seconds (default 0: serving reclaims at once; "
        "the scheduler's own default is 600)",
    )
    p.add_argument(
        "--startup",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds from a replica's placement to ready: image, weights, warm-up (default 600)",
    )
    p.set_defaults(func=cmd_sim_serving)
