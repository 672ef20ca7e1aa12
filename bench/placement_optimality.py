"""How good the bounded exact placement search is: large gangs on a churned 2,048-node fabric, bounded vs unbounded.

The fabric: 2,048 nodes x 8 GPUs (--nodes), 64 leaves of 32 nodes, 4 spines of 16 leaves. It is churned by a mix of small
gangs (1 to 64 GPUs, 1 to 8 GPUs per replica, placed by the core and released at random) between 75% and 92%
utilization, so free GPUs are scattered over partly used nodes of every leaf. Then --gangs large gangs (256 to
2,048 GPUs, as 1, 2, 4 or 8 GPUs per replica, so nodes hold several replicas each and the knapsack over leaves and
nodes matters) are placed one after another on that state, each by

- the unbounded search (no time budget, no work bound): the reference, and its time;
- the search under the default bounds (`phalanx.core.capacity.PLACEMENT_BUDGET_MS`, `placement._EXACT_CELLS`);
- the search under each --budgets time budget (with the default work bound), and under each --cells work bound
  alone (no time budget; 20,000 was the bound before the time budget existed).

A gang is "worse" when its placement's objective vector (the lowest tier crossed, then the domains it uses at each
level below, down to nodes, recomputed from its nodes) is lexicographically above the unbounded one's. Each large
gang is only looked at, not reserved; the churn goes on between two of them.

Target: no gang worse under the default bounds (the reason says when a bound stopped the search, and is checked to
say so whenever the placement is worse).

Run: .venv/bin/python bench/placement_optimality.py [--gangs 48] [--budgets 2,5,10,20,50] [--quick] [--no-targets]
Human lines go to stderr; the last line on stdout is one JSON object with every figure; exit 1 when the target is
missed (--no-targets: only print).
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

from phalanx.core import placement
from phalanx.core.capacity import PLACEMENT_BUDGET_MS, ClusterCapacity, domain_key
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang

NODES, GPUS, PER_LEAF, LEAVES_PER_SPINE = 2048, 8, 32, 16
SMALL = [
    ((1, 1), 30),
    ((1, 2), 12),
    ((1, 4), 12),
    ((1, 8), 10),
    ((2, 8), 6),
    ((4, 4), 6),
    ((8, 2), 4),
    ((8, 8), 4),
    ((16, 4), 3),
    ((32, 2), 2),
]
LARGE = [(gpus // g, g) for gpus in (256, 512, 1024, 2048) for g in (1, 2, 4, 8)]
HIGH, LOW = 0.92, 0.75  # churn: past HIGH utilization (or on a failure), release random gangs down to LOW
UNBOUNDED = 10**18  # a work bound no search reaches


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def vector(cap: ClusterCapacity, p: Placement) -> tuple[int, ...]:
    """(lowest level one domain of which holds every node, then the domains used at each level below it)."""
    top = cap.levels()
    nodes = [cap.nodes[n] for n in p.nodes]
    for level in range(top + 1):
        if len({domain_key(n, level, top) for n in nodes}) == 1:
            return (level, *(len({domain_key(n, lv, top) for n in nodes}) for lv in range(level - 1, -1, -1)))
    raise AssertionError("the cluster level is one domain")


class Churn:
    def __init__(self, seed: int, nodes: int = NODES) -> None:
        names = [f"n{i:05d}" for i in range(nodes)]
        self.fabric = default_fabric(names, nodes_per_leaf=PER_LEAF, leaves_per_spine=LEAVES_PER_SPINE)
        self.cap = ClusterCapacity(NodeCapacity(n, GPUS, set(range(GPUS)), True, self.fabric.path(n)) for n in names)
        self.rng = random.Random(seed)
        self.held: dict[str, Placement] = {}
        self.job = 0
        self.total = self.cap.total_gpus()

    def utilization(self) -> float:
        return 1 - self.cap.free_gpus() / self.total

    def run(self, steps: int) -> None:
        shapes, weights = zip(*SMALL, strict=True)
        for _ in range(steps):
            replicas, g = self.rng.choices(shapes, weights)[0]
            self.job += 1
            got = place_gang(self.cap, GangRequest(f"s{self.job}", replicas, g), self.fabric.tiers)
            if isinstance(got, Placement):
                self.cap.reserve(got)
                self.held[got.job_id] = got
            if not isinstance(got, Placement) or self.utilization() > HIGH:
                while self.held and self.utilization() > LOW:
                    victim = self.rng.choice(list(self.held))
                    self.cap.release_placement(self.held.pop(victim))


def timed(cap: ClusterCapacity, request: GangRequest, tiers, **bounds) -> tuple[Placement | None, float]:
    t0 = time.perf_counter()
    got = place_gang(cap, request, tiers, **bounds)
    return (got if isinstance(got, Placement) else None), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gangs", type=int, default=48)
    ap.add_argument("--nodes", type=int, default=NODES, help="nodes of 8 GPUs (a multiple of 512 keeps spines whole)")
    ap.add_argument("--budgets", default="2,5,10,20,50", help="time budgets to try, ms")
    ap.add_argument("--cells", default="20000,200000,2000000", help="work bounds to try alone (no time budget)")
    ap.add_argument("--warmup", type=int, default=20000, help="churn steps before the first large gang")
    ap.add_argument("--between", type=int, default=300, help="churn steps between two large gangs")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16 gangs, 5,000 warm-up steps")
    ap.add_argument("--no-targets", action="store_true", help="only print the target; exit 0 even when missed")
    args = ap.parse_args()
    if args.quick:
        args.gangs, args.warmup = 16, 5000
    budgets = [float(b) for b in args.budgets.split(",") if b]
    cell_bounds = [int(c) for c in args.cells.split(",") if c]

    say(
        f"fabric: {args.nodes} nodes x {GPUS} GPUs, {args.nodes // PER_LEAF} leaves of {PER_LEAF}, "
        f"{args.nodes // PER_LEAF // LEAVES_PER_SPINE} spines of {LEAVES_PER_SPINE} leaves; default bounds "
        f"{PLACEMENT_BUDGET_MS:g} ms and {placement._EXACT_CELLS:,} DP cells per knapsack"
    )
    churn = Churn(args.seed, args.nodes)
    churn.run(args.warmup)
    variants: dict[str, dict] = {"default": {}}
    variants.update({f"{b:g} ms": {"budget_ms": b} for b in budgets})
    variants.update({f"{c:,} cells": {"budget_ms": 0.0, "cells": c} for c in cell_bounds})
    result: dict[str, dict] = {
        name: {"worse": 0, "stopped": 0, "noted": 0, "unnoted_worse": 0, "ms": []} for name in variants
    }
    reference_ms: list[float] = []
    rows = []
    for i in range(args.gangs):
        replicas, g = LARGE[i % len(LARGE)]
        request = GangRequest(f"L{i}", replicas, g)
        cap, tiers = churn.cap, churn.fabric.tiers
        best, ref_s = timed(cap, request, tiers, budget_ms=0.0, cells=UNBOUNDED)
        row = {"gang": f"{replicas}x{g}", "utilization": round(churn.utilization(), 3), "unbounded_ms": ref_s * 1e3}
        if best is not None:
            reference_ms.append(ref_s * 1e3)
            want = vector(cap, best)
            row["unbounded"] = want
            for name, bounds in variants.items():
                got, dt = timed(cap, request, tiers, **bounds)
                r = result[name]
                r["ms"].append(dt * 1e3)
                assert got is not None, f"{request.job_id}: placed unbounded, not under {name}"
                have = vector(cap, got)
                worse = have > want
                assert have >= want, f"{request.job_id}: {name} beat the unbounded search: {have} < {want}"
                noted = "(exact search" in got.reason
                r["worse"] += worse
                r["stopped"] += "budget: heuristic" in got.reason
                r["noted"] += noted
                r["unnoted_worse"] += worse and not noted
                row[name] = have
        rows.append(row)
        say(
            f"  {request.job_id:>4} {replicas:>5} x {g}: unbounded {ref_s * 1e3:6.1f} ms {row.get('unbounded')}"
            + "".join(f"; {name} {row[name]}" for name in variants if name in row and row[name] != row["unbounded"])
        )
        churn.run(args.between)

    placed = len(reference_ms)
    say(
        f"{placed}/{args.gangs} large gangs placed; unbounded search {min(reference_ms):.1f}-{max(reference_ms):.1f} ms "
        f"(median {sorted(reference_ms)[placed // 2]:.1f} ms)"
    )
    summary = {}
    for name, r in result.items():
        ms = sorted(r.pop("ms"))
        summary[name] = {
            **r,
            "max_ms": round(ms[-1], 2) if ms else None,
            "median_ms": round(ms[len(ms) // 2], 2) if ms else None,
        }
        say(
            f"  {name:>17}: {r['worse']:>2}/{placed} worse; stopped on time {r['stopped']:>2}; reason notes a bound "
            f"{r['noted']:>2}; median {summary[name]['median_ms']} ms, max {summary[name]['max_ms']} ms"
        )
    default = summary["default"]
    checks = {
        "default_worse": [default["worse"], 0, default["worse"] == 0],
        "worse_but_not_noted": [
            sum(r["unnoted_worse"] for r in summary.values()),
            0,
            all(r["unnoted_worse"] == 0 for r in summary.values()),
        ],
    }
    for name, (got, want, ok) in checks.items():
        say(f"target {name}: {got} vs {want}: {'met' if ok else 'MISSED'}")
    missed = [name for name, (_, _, ok) in checks.items() if not ok]
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "gangs": args.gangs,
                "placed": placed,
                "default_budget_ms": PLACEMENT_BUDGET_MS,
                "default_cells": placement._EXACT_CELLS,
                "unbounded_ms": {
                    "min": round(min(reference_ms), 2),
                    "median": round(sorted(reference_ms)[placed // 2], 2),
                    "max": round(max(reference_ms), 2),
                },
                "variants": summary,
                "targets": checks,
                "missed": missed,
                "rows": rows,
            }
        )
    )
    if missed and not args.no_targets:
        say(f"targets missed: {', '.join(missed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
