"""Replay speed of the simulator: 100,000 jobs on a 4,096-node x 8-GPU fat-tree, on one core.

`phalanx.sim.engine.simulate` replays the jobs through the scheduler's own core (every pass is
`phalanx.core.backfill.schedule_with_backfill` on a `ClusterCapacity`, placements by `place_gang`), once per policy
(default: gang-backfill and topo). Events per second = (arrivals + finishes + scheduling passes) / wall time, the
simulator's own `events_per_s`.

The workload: jobs resampled (seeded) from the Philly-derived trace when the data is there (`find_data`: --data,
$PHALANX_DATA, ../shared/data), each a (gang shape, duration) pair of a real job; otherwise synthetic from a
Philly-like mix (mostly 1 GPU, some 2/4/8, a few 16-256-GPU gangs; log-normal durations, median ~20 min).
Durations are capped at --max-hours (default 4, about Philly's 90th percentile: its tail runs for weeks and would
turn a replay of a few hours of arrivals into a drain). Arrivals are Poisson at the rate that offers --load (default
1.0) of the cluster's GPU hours, so the cluster runs full while jobs arrive ("utilization while arriving" below:
the replay's timeline from one longest job after the first arrival to the last; `utilization_allocated` is over
the whole makespan, the ramp-up and the drain included), with the queue delays that go with it (mostly short: the
small jobs fill the gaps at once; --load 1.1 keeps a queue that grows).

Baseline in the same run (--baseline TREE): the same replay, smaller (--baseline-jobs 20000 --baseline-nodes
1024), run by the scheduler code of another checkout (e.g. `git worktree add /tmp/simbase <commit>`) and by this
one, each in its own process; the figures (completed, mean JCT, utilization, passes) must be identical, and the
speed-up is reported.

Run: .venv/bin/python bench/sim_replay.py [--jobs 100000] [--nodes 4096] [--policy gang-backfill,topo]
     [--load 1.0] [--max-hours 4] [--seed 0] [--synthetic] [--baseline /tmp/simbase] [--quick] [--no-targets]
Progress goes to stderr; the last stdout line is one JSON object with every figure. Exit 1 when the results differ
from the baseline's (--no-targets: only print).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUS = 8
# Synthetic mix when no trace data is found: (GPUs, weight) and log-normal durations (median, sigma).
SYNTH_SIZES = [(1, 68), (2, 4), (4, 13), (8, 12), (16, 1.6), (32, 0.8), (64, 0.4), (128, 0.15), (256, 0.05)]
SYNTH_MEDIAN_S, SYNTH_SIGMA = 1186.0, 2.0
SAME = (
    "completed",
    "jct_mean_h",
    "utilization_allocated",
    "scheduling_passes",
    "queue_delay_mean_h",
    "multi_node_gangs",
)


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _import_tree(tree: Path) -> None:
    sys.path.insert(0, str(tree))


def workload(n: int, nodes: int, load: float, seed: int, max_hours: float, synthetic: bool, data: str | None):
    """n jobs (TraceJob), arrivals Poisson at the rate that offers `load` of nodes x 8 GPUs."""
    from phalanx.sim.traces import DataNotFound, TraceJob, find_data, load_trace

    rng = random.Random(seed)
    cap = max_hours * 3600.0
    source = "synthetic"
    pool: list[tuple[int, int, float, str]] = []
    if not synthetic:
        try:
            trace = load_trace("philly", find_data(data))
            pool = [
                (j.replicas, j.gpus_per_replica, j.duration_s, j.tenant)
                for j in trace
                if j.gpus_per_replica <= GPUS and j.replicas * j.gpus_per_replica <= nodes * GPUS
            ]
            source = f"philly ({len(trace)} jobs resampled)"
        except DataNotFound:
            pool = []
    shapes = []
    for _ in range(n):
        if pool:
            r, g, d, tenant = pool[rng.randrange(len(pool))]
        else:
            gpus = rng.choices([s for s, _ in SYNTH_SIZES], [w for _, w in SYNTH_SIZES])[0]
            r, g = (1, gpus) if gpus <= GPUS else (gpus // GPUS, GPUS)
            d = max(1.0, rng.lognormvariate(math.log(SYNTH_MEDIAN_S), SYNTH_SIGMA))
            tenant = f"t{rng.randrange(15):02d}"
        shapes.append((r, g, min(d, cap), tenant))
    mean_work = sum(r * g * d for r, g, d, _ in shapes) / n  # GPU-seconds per job
    rate = load * nodes * GPUS / mean_work  # jobs per second
    jobs, t = [], 0.0
    for i, (r, g, d, tenant) in enumerate(shapes):
        t += rng.expovariate(rate)
        jobs.append(
            TraceJob(
                job_id=f"j{i:06d}",
                tenant=tenant,
                submit_s=t,
                replicas=r,
                gpus_per_replica=g,
                gpu_milli=0,
                duration_s=d,
                source="bench",
            )
        )
    return jobs, source, rate


def replay(args, policy: str, quiet: bool = False) -> dict:
    from phalanx.sim.engine import ClusterSpec, simulate

    jobs, source, rate = workload(
        args.jobs, args.nodes, args.load, args.seed, args.max_hours, args.synthetic, args.data
    )
    if not quiet:
        gpus = sorted(j.replicas * j.gpus_per_replica for j in jobs)
        say(
            f"[{policy}] {len(jobs)} jobs from {source} on {args.nodes} x {GPUS} GPUs: arrivals over "
            f"{jobs[-1].submit_s / 3600:.1f} h ({rate:.3f}/s), median {gpus[len(gpus) // 2]} GPU(s), "
            f"largest {gpus[-1]}, {sum(g > 8 for g in gpus)} multi-node"
        )
    t0 = time.perf_counter()
    last = [t0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if not quiet and (now - last[0] >= 5.0 or done == total):
            last[0] = now
            say(f"[{policy}] {done}/{total} jobs done, {now - t0:.0f} s")

    cluster = ClusterSpec(args.nodes, GPUS)
    result = simulate(jobs, cluster, policy, depth=args.depth, progress=progress)
    wall = time.perf_counter() - t0
    m = result.metrics
    end = jobs[-1].submit_s
    # Steady state: from one longest job after the first arrival (the ramp-up) to the last arrival.
    start = min(jobs[0].submit_s + args.max_hours * 3600.0, end / 2)
    busy = [f for t, f in result.timeline if start <= t <= end]
    out = {k: m[k] for k in SAME}
    out.update(
        policy=policy,
        jobs=len(jobs),
        nodes=args.nodes,
        source=source,
        wall_s=round(wall, 2),
        events=2 * len(jobs) + m["scheduling_passes"],
        events_per_s=round((2 * len(jobs) + m["scheduling_passes"]) / wall, 1),
        utilization_while_arriving=sum(busy) / len(busy) if busy else float("nan"),
        makespan_h=m["makespan_h"],
        queue_delay_p99_h=m["queue_delay_p99_h"],
        idle_gpu_hours_while_jobs_wait=m["idle_gpu_hours_while_jobs_wait"],
    )
    if not quiet:
        say(
            f"[{policy}] {out['events']} events in {wall:.1f} s: {out['events_per_s']:.0f} events/s; "
            f"completed {out['completed']}/{len(jobs)}, utilization {out['utilization_allocated']:.3f} "
            f"(while arriving {out['utilization_while_arriving']:.3f}), mean JCT {out['jct_mean_h']:.2f} h, "
            f"queue delay mean {out['queue_delay_mean_h'] * 3600:.0f} s, p99 {out['queue_delay_p99_h'] * 3600:.0f} s"
        )
    return out


def child(tree: Path, args, policy: str, jobs: int, nodes: int) -> dict:
    """One replay by the code of `tree`, in its own process (so two checkouts never share a module)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--tree",
        str(tree),
        "--jobs",
        str(jobs),
        "--nodes",
        str(nodes),
        "--policy",
        policy,
        "--load",
        str(args.load),
        "--seed",
        str(args.seed),
        "--max-hours",
        str(args.max_hours),
        "--depth",
        str(args.depth),
    ]
    if args.synthetic:
        cmd.append("--synthetic")
    if args.data:
        cmd += ["--data", args.data]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=os.getcwd())
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--policy", default="gang-backfill,topo", help="comma-separated")
    ap.add_argument("--load", type=float, default=1.0, help="offered GPU-hours / cluster GPU-hours")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-hours", type=float, default=4.0, help="cap on a job's duration")
    ap.add_argument("--depth", type=int, default=200, help="backfill depth (gangs looked at behind the head)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic mix even when trace data is found")
    ap.add_argument("--data", default=None, help="trace data folder (default: find_data)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    ap.add_argument("--baseline-jobs", type=int, default=20_000)
    ap.add_argument("--baseline-nodes", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="10,000 jobs on 512 nodes")
    ap.add_argument("--no-targets", action="store_true", help="only print; exit 0 even when results differ")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.nodes = 10_000, 512
    _import_tree(args.tree)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.child:
        print(json.dumps(replay(args, policies[0], quiet=True)))
        return 0
    figures: dict = {
        "jobs": args.jobs,
        "nodes": args.nodes,
        "gpus_per_node": GPUS,
        "load": args.load,
        "seed": args.seed,
        "max_hours": args.max_hours,
        "depth": args.depth,
        "runs": {},
    }
    ok = True
    if args.baseline is not None:
        figures["baseline"] = {}
        for policy in policies:
            say(
                f"[baseline] {policy}: {args.baseline_jobs} jobs on {args.baseline_nodes} nodes, "
                f"{args.baseline} against {ROOT} ..."
            )
            before = child(args.baseline.resolve(), args, policy, args.baseline_jobs, args.baseline_nodes)
            after = child(ROOT, args, policy, args.baseline_jobs, args.baseline_nodes)
            same = all(before[k] == after[k] for k in SAME)
            ok &= same
            say(
                f"[baseline] {policy}: before {before['events_per_s']:.0f} events/s ({before['wall_s']:.1f} s), "
                f"after {after['events_per_s']:.0f} events/s ({after['wall_s']:.1f} s): "
                f"{before['wall_s'] / after['wall_s']:.1f}x; same results: {same}"
            )
            if not same:
                say(
                    f"[baseline] {policy}: differ: "
                    + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in SAME if before[k] != after[k])
                )
            figures["baseline"][policy] = {
                "before": before,
                "after": after,
                "speedup": round(before["wall_s"] / after["wall_s"], 2),
                "same_results": same,
            }
    for policy in policies:
        out = replay(args, policy)
        figures["runs"][policy] = out
        print(
            f"{policy}: {out['events_per_s']:.0f} events/s, wall {out['wall_s']:.1f} s, completed "
            f"{out['completed']}/{out['jobs']}, utilization {out['utilization_allocated']:.3f} "
            f"(while arriving {out['utilization_while_arriving']:.3f})"
        )
    figures["same_results_as_baseline"] = ok if args.baseline is not None else None
    print(json.dumps(figures))
    return 0 if ok or args.no_targets else 1


if __name__ == "__main__":
    sys.exit(main())
