"""Speed of placing segmented gangs with spares kept in the domain (issue 34), and of the swap decision, at frontier
scale: the cluster of bench/segments.py (1,152 GB200 NVL72 trays, 4 GPUs each, in 64 NVLink domains, part-filled
from each trial's seed).

Shapes (replicas x GPUs / replicas per segment + spares per segment): 256x4/16+2 (16 racks, 16 trays training and 2
spares each: 288 trays reserved), 64x4/16+2, 32x4/8+1, 8x4/4+1. A gang with spares is placed as segments of S + K
(the scheduler's JobRecord.request) and split (core.spares.split_spares); it is timed against the same gang without
spares. Then, on each placed gang, every node of the gang is lost in turn and the swap decision
(gang_recovery.choose_swap, through recovery.decide_recovery, and swapped_allocations) is timed.

Run: .venv/bin/python bench/spares.py [--trials 40] [--seed 0]
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from segments import DOMAINS, GPUS, TRAYS, fabric, part_filled, pct, timed

from phalanx.core.gang_recovery import choose_swap
from phalanx.core.model import GangRequest, Placement
from phalanx.core.spares import inflated, split_spares, swapped_allocations

SHAPES = [(256, 16, 2), (64, 16, 2), (32, 8, 1), (8, 4, 1)]  # (replicas, per segment, spares per segment)


def swap_times(gang: Placement, slots, s: int) -> list[float]:
    """The swap decision for the loss of each node of the gang, in microseconds."""
    allocations = [(r.replica, r.node, tuple(r.gpus)) for r in gang.replicas]
    actives = [(r, n) for r, n, _ in allocations]
    out = []
    for dead in dict.fromkeys(n for _, n, _ in allocations):
        gc.disable()
        try:
            start = time.perf_counter()
            chosen = choose_swap(actives, slots, s, gang.segments, dead)
            assert chosen is not None
            swapped_allocations(allocations, chosen)
            out.append((time.perf_counter() - start) * 1e6)
        finally:
            gc.enable()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fab = fabric()
    tiers = tuple(fab.tiers)
    import random

    rows: dict[str, dict[str, list]] = {}
    for trial in range(args.trials):
        cap = part_filled(fab, random.Random(args.seed * 100_003 + trial))
        for replicas, s, k in SHAPES:
            key = f"{replicas}x{GPUS}/{s}+{k}"
            e = rows.setdefault(key, {"spares": [], "plain": [], "placed": [], "swap_us": []})
            r2, s2 = inflated(replicas, s, k)
            ms, got = timed(cap, GangRequest(f"sp-{key}", r2, GPUS, segment=s2), tiers)
            e["spares"].append(ms)
            e["placed"].append(isinstance(got, Placement))
            e["plain"].append(timed(cap, GangRequest(f"seg-{key}", replicas, GPUS, segment=s), tiers)[0])
            if isinstance(got, Placement):
                gang, slots = split_spares(got, s, k)
                assert len(gang.replicas) == replicas and len(slots) == replicas // s * k
                e["swap_us"] += swap_times(gang, slots, s)
    print(
        f"segmented gangs with spares on {DOMAINS * TRAYS:,} trays x {GPUS} GPUs in {DOMAINS} NVL72 domains, "
        f"part-filled, {args.trials} trials",
        file=sys.stderr,
    )
    print(
        f"{'gang':>16} {'spares p50':>11} {'p99':>8} {'no-spares p50':>14} {'swap p50 us':>12} {'p99':>8} placed",
        file=sys.stderr,
    )
    summary = {}
    for replicas, s, k in SHAPES:
        key = f"{replicas}x{GPUS}/{s}+{k}"
        e = rows[key]
        row = {
            "spares_p50_ms": round(pct(e["spares"], 0.5), 3),
            "spares_p99_ms": round(pct(e["spares"], 0.99), 3),
            "no_spares_p50_ms": round(pct(e["plain"], 0.5), 3),
            "swap_p50_us": round(pct(e["swap_us"], 0.5), 1) if e["swap_us"] else None,
            "swap_p99_us": round(pct(e["swap_us"], 0.99), 1) if e["swap_us"] else None,
            "placed": sum(e["placed"]),
        }
        summary[key] = row
        print(
            f"{key:>16} {row['spares_p50_ms']:>11.3f} {row['spares_p99_ms']:>8.3f} {row['no_spares_p50_ms']:>14.3f} "
            f"{row['swap_p50_us'] or 0:>12.1f} {row['swap_p99_us'] or 0:>8.1f} {row['placed']}/{args.trials}",
            file=sys.stderr,
        )
    print(json.dumps({"bench": "spares", "nodes": DOMAINS * TRAYS, "trials": args.trials, "shapes": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
