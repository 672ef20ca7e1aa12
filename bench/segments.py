"""Speed of multi-level gang placement (segments, issue 34) at frontier scale, against the plain gang of the same size.

The fabric: 1,152 GB200 NVL72 trays (4 GPUs each) in 64 NVLink domains of 18 trays, 4 domains (one row, 72 trays)
per leaf, 4 leaves per spine (4 spines). Each trial builds a part-filled cluster from its seed: 40 of the 64
domains (chosen at random) have 1 to 6 random trays busy and a random 20% of their other trays carry a 2-GPU job;
the other 24 domains are whole, as they must be for 16 segments of 18 trays. Every gang shape below is then placed
on that same cluster twice, segmented and plain (the same replicas x GPUs, no segments), each timed with
time.perf_counter around place_gang (nothing is reserved: every placement sees the same cluster).

Shapes (replicas x GPUs, replicas per segment): 288x4 in 16 segments of 18 trays (a 1,152-GPU gang, one NVL72 per
segment), 72x4 in 4 of 18, 64x4 in 8 of 8, 36x4 in 4 of 9, 32x4 in 8 of 4, 8x4 in 2 of 4.

The bound (placement/segments.py): O(D) to read the D = 64 domains, a plain placement of R/S replicas on D virtual
nodes, then R/S placements of S replicas inside one domain each, each search within the time budget.

Run: .venv/bin/python bench/segments.py [--trials 60] [--seed 0]
Prints a table (p50/p99 ms, segmented and plain, and how many placed) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.fabric import Fabric, default_fabric, group_nvlink_domains
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import domain_of, place_gang

DOMAINS, TRAYS, GPUS = 64, 18, 4
PER_LEAF, LEAVES_PER_SPINE = 4, 4
SHAPES = [(288, 18), (72, 18), (64, 8), (36, 9), (32, 4), (8, 4)]  # (replicas, per segment), 4 GPUs each


def fabric() -> Fabric:
    names = [f"gb{i:04d}" for i in range(DOMAINS * TRAYS)]
    plain = default_fabric(names, nodes_per_leaf=TRAYS * PER_LEAF, leaves_per_spine=LEAVES_PER_SPINE)
    return group_nvlink_domains(plain, TRAYS)


def part_filled(fab: Fabric, rng: random.Random) -> ClusterCapacity:
    by_domain: dict[str, list[str]] = {}
    for name in sorted(fab.paths):
        by_domain.setdefault(fab.path(name)[0], []).append(name)
    busy: dict[str, set[int]] = {}
    for domain in rng.sample(sorted(by_domain), 40):
        for tray in rng.sample(by_domain[domain], rng.randint(1, 6)):
            busy[tray] = set(range(GPUS))
        for tray in by_domain[domain]:
            if tray not in busy and rng.random() < 0.2:
                busy[tray] = {0, 1}
    cap = ClusterCapacity(
        NodeCapacity(n, GPUS, set(range(GPUS)) - busy.get(n, set()), True, fab.path(n)) for n in sorted(fab.paths)
    )
    cap.levels()  # the index is built once, as the scheduler keeps it between cycles
    gc.collect()  # the garbage of building it is not charged to the first placement timed
    return cap


def timed(cap: ClusterCapacity, request: GangRequest, tiers: tuple[str, ...]) -> tuple[float, object]:
    """One placement in ms (the collector off meanwhile: its pauses belong to whoever made the garbage)."""
    gc.disable()
    try:
        start = time.perf_counter()
        got = place_gang(cap, request, tiers)
        return (time.perf_counter() - start) * 1e3, got
    finally:
        gc.enable()


def check(cap: ClusterCapacity, p: Placement, s: int) -> None:
    """Each segment's contiguous ranks in one NVLink domain, and no GPU twice."""
    for i in range(0, len(p.replicas), s):
        assert len({domain_of(cap.nodes[r.node], 1) for r in p.replicas[i : i + s]}) == 1
    taken = [(r.node, g) for r in p.replicas for g in r.gpus]
    assert len(taken) == len(set(taken))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fab = fabric()
    tiers = tuple(fab.tiers)
    results: dict[str, dict[str, list]] = {}
    spine_spans: dict[str, list[int]] = {}
    for trial in range(args.trials):
        rng = random.Random(args.seed * 100_003 + trial)
        cap = part_filled(fab, rng)
        for replicas, s in SHAPES:
            key = f"{replicas}x{GPUS}/{s}"
            entry = results.setdefault(key, {"seg": [], "plain": [], "seg_placed": [], "plain_placed": []})
            # Alternate which goes first so neither gains from the other's warm caches.
            order = [("seg", s), ("plain", 0)] if trial % 2 == 0 else [("plain", 0), ("seg", s)]
            for kind, segment in order:
                ms, got = timed(cap, GangRequest(f"{kind}-{key}", replicas, GPUS, segment=segment), tiers)
                entry[kind].append(ms)
                entry[f"{kind}_placed"].append(isinstance(got, Placement))
                if kind == "seg" and isinstance(got, Placement):
                    check(cap, got, s)
                    spine_spans.setdefault(key, []).append(len({domain_of(cap.nodes[n], 3) for n in got.nodes}))
    print(
        f"segmented gangs on {DOMAINS * TRAYS:,} trays x {GPUS} GPUs in {DOMAINS} NVL72 domains "
        f"({DOMAINS // PER_LEAF} leaves, {DOMAINS // PER_LEAF // LEAVES_PER_SPINE} spines), part-filled, "
        f"{args.trials} trials",
        file=sys.stderr,
    )
    header = f"{'gang':>12} {'segments':>10} {'seg p50':>9} {'seg p99':>9} {'plain p50':>10} {'plain p99':>10} placed"
    print(header, file=sys.stderr)
    summary = {}
    for replicas, s in SHAPES:
        key = f"{replicas}x{GPUS}/{s}"
        e = results[key]
        row = {
            "segments": replicas // s,
            "segment_trays": s,
            "seg_p50_ms": round(pct(e["seg"], 0.5), 3),
            "seg_p99_ms": round(pct(e["seg"], 0.99), 3),
            "seg_mean_ms": round(statistics.fmean(e["seg"]), 3),
            "plain_p50_ms": round(pct(e["plain"], 0.5), 3),
            "plain_p99_ms": round(pct(e["plain"], 0.99), 3),
            "seg_placed": sum(e["seg_placed"]),
            "plain_placed": sum(e["plain_placed"]),
            "seg_spines_max": max(spine_spans.get(key, [0])),
        }
        summary[key] = row
        print(
            f"{replicas}x{GPUS:>2}{'':>5} {f'{replicas // s} x {s}':>10} {row['seg_p50_ms']:>9.3f} "
            f"{row['seg_p99_ms']:>9.3f} {row['plain_p50_ms']:>10.3f} {row['plain_p99_ms']:>10.3f} "
            f"{row['seg_placed']}/{args.trials} seg, {row['plain_placed']}/{args.trials} plain",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "segments",
                "nodes": DOMAINS * TRAYS,
                "domains": DOMAINS,
                "trials": args.trials,
                "shapes": summary,
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
