"""What an operator's spare pool costs placement (issue 34, item 2): place_gang with the pool's nodes hidden from a
gang without a time limit (and tried last for one with a time limit), against the same cluster with no pool.

The cluster is bench/segments.py's: 1,152 GB200 NVL72 trays (4 GPUs each) in 64 NVLink domains of 18, part-filled
from each trial's seed. The pool books 2 idle trays per domain (`phalanx pool create racks --tier nvlink
--per-domain 2`, up to 128 trays), the first idle ones by name, as the scheduler's booking does. Each gang shape is
placed three ways on that same cluster (nothing reserved): no pool; a pool and no time limit (the pool's trays
hidden); a pool and a time limit (placed off the pool first, on it only when that fails), each timed with
time.perf_counter around place_gang.

The bound: placement of a gang without a time limit reads a view of the cluster less the pools' nodes
(ClusterCapacity.unlent), kept up to date with every reservation and release and rebuilt, O(nodes), only when the
pools' booking changes (timed apart below); so it costs what a placement on that smaller cluster costs. A
time-limited gang is placed on that view first and, only when it fits nowhere there, on the whole cluster (a
second search).

Run: .venv/bin/python bench/pools.py [--trials 30] [--seed 0]
Prints a table (p50/p99 ms per way, and how many placed) and ends with one JSON line.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from segments import fabric, part_filled

from phalanx.core.model import GangRequest, Placement
from phalanx.core.placement import place_gang

SHAPES = [(64, 8), (36, 9), (32, 4), (8, 4), (8, 0), (1, 0)]  # (replicas, per segment; 0 plain), 4 GPUs each
PER_DOMAIN = 2


def pool_nodes(cap, fab) -> frozenset[str]:
    by_domain: dict[str, list[str]] = {}
    for name in sorted(cap.nodes):
        node = cap.nodes[name]
        if len(node.free) == node.total:
            by_domain.setdefault(fab.path(name)[0], []).append(name)
    return frozenset(n for names in by_domain.values() for n in names[:PER_DOMAIN])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    fab = fabric()
    times: dict[tuple[str, int, int], list[float]] = {}
    placed: dict[tuple[str, int, int], int] = {}
    gc.disable()
    builds = []
    for trial in range(args.trials):
        plain = part_filled(fab, random.Random(args.seed + trial))
        pooled = part_filled(fab, random.Random(args.seed + trial))
        pool = pool_nodes(pooled, fab)
        pooled.lending = pool
        t0 = time.perf_counter()
        pooled.unlent().levels()  # built once per change of the pools' booking, not per placement
        builds.append((time.perf_counter() - t0) * 1000)
        for replicas, segment in SHAPES:
            for way, cap, limit in (("no pool", plain, 0.0), ("pool", pooled, 0.0), ("pool+limit", pooled, 3600.0)):
                request = GangRequest(f"g{trial}", replicas, 4, segment=segment, time_limit=limit)
                t0 = time.perf_counter()
                got = place_gang(cap, request, fab.tiers)
                key = (way, replicas, segment)
                times.setdefault(key, []).append((time.perf_counter() - t0) * 1000)
                placed[key] = placed.get(key, 0) + isinstance(got, Placement)
    gc.enable()
    rows = []
    print(f"{'shape':<16} {'way':<11} {'p50 ms':>8} {'p99 ms':>8} {'placed':>7}")
    for (way, replicas, segment), ts in times.items():
        ts.sort()
        p50, p99 = statistics.median(ts), ts[min(len(ts) - 1, int(len(ts) * 0.99))]
        shape = f"{replicas}x4" + (f" seg {segment}" if segment else "")
        n = placed[(way, replicas, segment)]
        print(f"{shape:<16} {way:<11} {p50:>8.2f} {p99:>8.2f} {n:>4}/{len(ts)}")
        rows.append(dict(shape=shape, way=way, p50_ms=round(p50, 3), p99_ms=round(p99, 3), placed=n, trials=len(ts)))
    build = statistics.median(builds)
    print(f"the pool-less view, built once per booking change: p50 {build:.2f} ms")
    out = {"bench": "pools", "trials": args.trials, "per_domain": PER_DOMAIN, "view_build_p50_ms": round(build, 3)}
    print(json.dumps({**out, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
