"""Multi-tenant scheduling at scale: 10,000 queued gangs from 50 tenants on a 4,096-node x 8-GPU fat-tree.

Each tenant has its own queue in one cohort, with a fair-share weight of 1 to 5 and a nominal quota of its
weight's share of the cluster (borrowing allowed: idle quota is lent). 10,000 gangs (1x1 ... 16x8 GPUs, time
limits 10-60 min) are queued at once, 200 per tenant. Then, cycle after cycle, the scheduling pass runs over
everything still waiting (`phalanx.core.backfill.schedule_with_backfill` with a `QuotaBook`: fair order, quota
admission, placement, EASY backfill), and between cycles the running gangs whose runtime is over finish (simulated
clock, 300 s between cycles by default) and each tenant submits new gangs to keep 200 waiting.

Figures: the time of a scheduling cycle (p50, p99, max), gangs placed per second of cycle time, and the fairness
error: each tenant's share of the GPUs in use, averaged over the steady-state cycles, against its target
(weight / total weight), as the largest and mean absolute difference. The baseline in the same run is the same
workload through plain priority-then-FIFO order without queues.

Run: .venv/bin/python bench/fair_share.py [--nodes 4096] [--tenants 50] [--queued 10000] [--cycles 16] [--quick]
Progress goes to stderr; the last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phalanx.core.backfill import RunningEnd, schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity
from phalanx.core.quota import FlavorQuota, QueueSpec, QuotaBook, usage_of

SHAPES = [((1, 1), 20), ((1, 2), 10), ((1, 4), 10), ((1, 8), 25), ((2, 8), 15), ((4, 8), 10), ((8, 8), 7), ((16, 8), 3)]


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def run(policy: str, args, rng_seed: int) -> dict:
    rng = random.Random(rng_seed)
    names = [f"n{i:04d}" for i in range(args.nodes)]
    fabric = default_fabric(names, nodes_per_leaf=32, leaves_per_spine=16)
    cap = ClusterCapacity(NodeCapacity(n, 8, set(range(8)), True, fabric.path(n)) for n in names)
    total = args.nodes * 8
    weights = {f"t{i:02d}": rng.randint(1, 5) for i in range(args.tenants)}
    wsum = sum(weights.values())
    specs = {
        t: QueueSpec(t, {"*": FlavorQuota(gpus=total * w / wsum)}, cohort="all", weight=w) for t, w in weights.items()
    }
    shapes = [s for s, _ in SHAPES]
    freq = [f for _, f in SHAPES]
    seq = 0
    owner: dict[str, str] = {}
    runtime: dict[str, float] = {}
    pending: list[GangRequest] = []
    per_tenant = max(1, args.queued // args.tenants)

    def submit(tenant: str, now: float) -> None:
        nonlocal seq
        seq += 1
        ((r, g),) = rng.choices(shapes, freq)
        limit = rng.uniform(600, 3600)
        job = f"j{seq:07d}"
        owner[job] = tenant
        runtime[job] = limit * rng.uniform(0.3, 1.0)
        pending.append(GangRequest(job, r, g, submitted_at=now + seq * 1e-6, time_limit=limit))

    for tenant in weights:
        for _ in range(per_tenant):
            submit(tenant, 0.0)
    running: dict[str, tuple[RunningEnd, float, GangRequest]] = {}
    cycle_ms, placed_per_s, samples = [], [], []
    memo: dict = {}
    now = 0.0
    for cycle in range(args.cycles):
        book = None
        if policy == "fair":
            book = QuotaBook(
                specs, usage_of((owner[j], "*", req) for j, (_, _, req) in running.items()), {"gpus": float(total)}
            )
        t0 = time.perf_counter()
        result = schedule_with_backfill(
            cap,
            pending,
            fabric.tiers,
            now=now,
            running=lambda: [g for g, _, _ in running.values()],
            memo=memo,
            book=book,
            queues=owner if book else None,
        )
        took = time.perf_counter() - t0
        cycle_ms.append(took * 1000)
        placed = {p.job_id: p for p in result.placements}
        placed_per_s.append(len(placed) / took if took > 0 else 0.0)
        by_id = {r.job_id: r for r in pending}
        for job_id, p in placed.items():
            req = by_id[job_id]
            running[job_id] = (RunningEnd(job_id, p, now + req.time_limit), now + runtime[job_id], req)
        pending = [r for r in pending if r.job_id not in placed]
        if cycle >= args.warmup:
            held = {t: 0 for t in weights}
            for job_id, (_, _, req) in running.items():
                held[owner[job_id]] += req.gpus
            used = sum(held.values()) or 1
            samples.append({t: held[t] / used for t in weights})
        say(
            f"  [{policy}] cycle {cycle + 1}/{args.cycles}: {len(placed)} placed in {took * 1000:.0f} ms, "
            f"{len(running)} running, {len(pending)} waiting, utilisation {1 - cap.free_gpus() / total:.1%}"
        )
        now += args.step
        for job_id in [j for j, (_, end, _) in running.items() if end <= now]:
            cap.release_placement(running.pop(job_id)[0].placement)
        waiting = {t: 0 for t in weights}
        for r in pending:
            waiting[owner[r.job_id]] += 1
        for tenant, n in waiting.items():
            for _ in range(per_tenant - n):
                submit(tenant, now)
    target = {t: w / wsum for t, w in weights.items()}
    mean = {t: sum(s[t] for s in samples) / len(samples) for t in weights}
    errors = [abs(mean[t] - target[t]) for t in weights]
    return {
        "cycle_ms_p50": round(pct(cycle_ms, 50), 1),
        "cycle_ms_p99": round(pct(cycle_ms, 99), 1),
        "cycle_ms_max": round(max(cycle_ms), 1),
        "first_cycle_ms": round(cycle_ms[0], 1),
        "steady_cycle_ms_p50": round(pct(cycle_ms[args.warmup :], 50), 1),
        "placed_per_s_first_cycle": round(placed_per_s[0]),
        "placed_per_s_steady_p50": round(pct(placed_per_s[args.warmup :], 50)),
        "fairness_error_max": round(max(errors), 4),
        "fairness_error_mean": round(sum(errors) / len(errors), 4),
        "fairness_error_max_relative": round(max(abs(mean[t] / target[t] - 1) for t in weights), 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=4096)
    p.add_argument("--tenants", type=int, default=50)
    p.add_argument("--queued", type=int, default=10_000)
    p.add_argument("--cycles", type=int, default=16)
    p.add_argument("--step", type=float, default=300.0, help="simulated seconds between cycles (default 300)")
    p.add_argument("--warmup", type=int, default=6, help="cycles before fairness is sampled")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="512 nodes, 20 tenants, 2,000 gangs, 8 cycles")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.tenants, args.queued, args.cycles, args.warmup = 512, 20, 2000, 12, 4
    say(
        f"{args.nodes} nodes x 8 GPUs, {args.tenants} tenants (one queue each, one cohort, weights 1-5), "
        f"{args.queued} gangs queued, {args.cycles} cycles {args.step:g} simulated seconds apart"
    )
    started = time.perf_counter()
    fair = run("fair", args, args.seed)
    fifo = run("fifo", args, args.seed)
    for name, r in (("fair share (queues, DRF, EASY backfill)", fair), ("baseline: priority + FIFO", fifo)):
        say(
            f"{name}: cycle p50 {r['cycle_ms_p50']} ms, p99 {r['cycle_ms_p99']} ms (first {r['first_cycle_ms']} ms, "
            f"steady p50 {r['steady_cycle_ms_p50']} ms); placed/s first cycle {r['placed_per_s_first_cycle']}, "
            f"steady p50 {r['placed_per_s_steady_p50']}; fairness error max {r['fairness_error_max']:.2%} of the "
            f"GPUs in use (mean {r['fairness_error_mean']:.2%}; worst tenant {r['fairness_error_max_relative']:.0%} "
            "off its target)"
        )
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "tenants": args.tenants,
                "queued": args.queued,
                "cycles": args.cycles,
                "fair": fair,
                "fifo": fifo,
                "elapsed_s": round(time.perf_counter() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
