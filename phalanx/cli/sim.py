"""``phalanx sim run``: replay a real trace through the scheduler's core under one or more policies, and write a
report (``result.json``, ``report.md``, PNG plots) to ``--out``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def cmd_sim_run(args: argparse.Namespace) -> int:
    from phalanx.sim.engine import POLICIES, ClusterSpec, equal_quotas, simulate
    from phalanx.sim.network import NetworkSpec
    from phalanx.sim.report import write_report
    from phalanx.sim.traces import DataNotFound, find_data, load_trace

    from .main import UsageError

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise UsageError(f"--policy: unknown {', '.join(unknown) or '(none)'}; policies: {', '.join(POLICIES)} "
                         "(comma-separated to compare several)")
    try:
        cluster = ClusterSpec.parse(args.cluster)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.failures < 0:
        raise UsageError("--failures must be >= 0 (failures per GPU-day, e.g. 4.7e-4)")
    try:
        data = find_data(args.data)
        jobs = load_trace(args.trace, data)
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
    too_big = [j for j in jobs if j.gpus_per_replica > cluster.gpus or j.replicas * j.gpus_per_replica >
               cluster.nodes * cluster.gpus]
    jobs = [j for j in jobs if j not in too_big]
    sys.stderr.write(f"[sim] {len(jobs)} jobs from {args.trace} ({len(too_big)} larger than the cluster left out) "
                     f"on {cluster.nodes} x {cluster.gpus} GPUs\n")
    results = []
    for policy in policies:
        def progress(done: int, total: int, policy=policy) -> None:
            sys.stderr.write(f"[sim] {policy}: {done}/{total} jobs done\n")
            sys.stderr.flush()

        network = None if args.no_network else NetworkSpec(oversubscription=cluster.oversub)
        quotas = equal_quotas(jobs, cluster.nodes * cluster.gpus) if args.quotas == "equal" else None
        result = simulate(jobs, cluster, policy, failures_per_gpu_day=args.failures, checkpoint=args.checkpoint,
                          seed=args.seed, progress=progress, network=network, quotas=quotas)
        m = result.metrics
        sys.stderr.write(f"[sim] {policy}: {m['completed']}/{m['jobs']} completed, utilisation "
                         f"{m['utilization_allocated']:.1%}, mean JCT {m['jct_mean_h']:.2f} h, "
                         f"{m['events_per_s']:.0f} events/s\n")
        results.append(result)
    doc = write_report(results, Path(args.out), f"Phalanx simulation: {args.trace} on {args.cluster}")
    sys.stderr.write(f"[sim] report in {Path(args.out) / 'report.md'}\n")
    print(json.dumps({"trace": args.trace, "cluster": args.cluster, "policies": doc}, default=float))
    return 0


def register(subparsers) -> None:
    from phalanx.sim.engine import POLICIES

    p = subparsers.add_parser("sim", help="trace-driven simulation through the scheduler's core")
    sub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", parser_class=type(p))
    sub.required = True
    run = sub.add_parser("run", help="replay a trace under one or more policies and write a report")
    run.add_argument("--trace", required=True, metavar="SPEC",
                     help="philly, philly:team=ID, alibaba:default, pollux:workload-1, ...")
    run.add_argument("--cluster", default="512x8,leaf=32,spine=16", metavar="SPEC",
                     help="NODESxGPUS[,leaf=N][,spine=N][,oversub=R] (default 512x8,leaf=32,spine=16; oversub: "
                          "leaf-to-spine oversubscription of the network model, 1 = non-blocking)")
    run.add_argument("--policy", default="gang-fifo,gang-backfill,topo", metavar="NAME[,NAME...]",
                     help=f"policies to compare: {', '.join(POLICIES)}")
    run.add_argument("--failures", type=float, default=0.0, metavar="RATE",
                     help="node failures per GPU-day (Llama 3: about 4.7e-4; default 0)")
    run.add_argument("--checkpoint", choices=["young-daly", "none"], default="young-daly",
                     help="on a failure, restart from the last Young/Daly checkpoint or from scratch")
    run.add_argument("--data", default=None, metavar="DIR", help="the data folder (default: $PHALANX_DATA, then "
                                                                  "../shared/data)")
    run.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N jobs of the trace")
    run.add_argument("--quotas", choices=["none", "equal"], default="none",
                     help="equal: each tenant of the trace (a Philly team) gets a queue with an equal share of the "
                          "cluster as its quota, in one cohort (borrowing idle quota), and fair share across them")
    run.add_argument("--no-network", action="store_true",
                     help="run times as in the trace (no AllReduce model: placement does not change speed)")
    run.add_argument("--arrival-scale", type=float, default=1.0, metavar="S",
                     help="multiply submit times by S (0.1: arrivals ten times as dense, to load a large cluster)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", required=True, metavar="DIR", help="where result.json, report.md and plots go")
    run.set_defaults(func=cmd_sim_run)
