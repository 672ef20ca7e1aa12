"""Speed of the pure placement core on a 4,096-node x 8-GPU rail-optimized fat-tree, against a naive full scan.

The fabric: 128 scalable units of 32 nodes, one leaf per SU, 16 SUs per spine group (8 spines). A steady mix of
gangs from 1 to 4,096 GPUs arrives (1, 2, 4, 8 GPUs on one node; 2x8, 8x8, 32x8, 128x8, 512x8 multi-node) and
placed gangs depart: whenever a placement fails a random placed gang is released and the same gang is tried again
(up to --retries times), and whenever utilization passes 90% random gangs are released, so the cluster stays
around 70-90% full. Every attempt is one decision; a decision is timed with time.perf_counter around
place_gang plus the reservation of what it placed.

The naive placer (in this file) has the same objective and tie-breaks but no index: for every tier it scans every
node to sum free capacity per domain, scans again for the chosen domain's members, and splits them with the scan
version of the take. It replays the same decision sequence (its first --naive-decisions decisions) and the run
checks that both choose the same nodes and GPUs.

--mix narrow adds multi-node gangs of 1, 2 and 4 GPUs per replica (4x4, 8x2, 16x4, 32x2, 64x1, 256x4): nodes then
hold several replicas each, so placement also weighs how many nodes (not only leaves and spines) a gang uses.

Run: .venv/bin/python bench/placement_speed.py [--decisions 20000] [--naive-decisions 3000] [--quick] [--mix narrow]
Human lines go to stderr; the last line on stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phalanx.core.capacity import ClusterCapacity, domain_key
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import Unplaceable, _build, _scan_cost, _take, place_gang

NODES, GPUS, PER_LEAF, LEAVES_PER_SPINE = 4096, 8, 32, 16
# (replicas, GPUs per replica) and how often each arrives
SHAPES = [
    ((1, 1), 30),
    ((1, 2), 12),
    ((1, 4), 12),
    ((1, 8), 16),
    ((2, 8), 10),
    ((8, 8), 8),
    ((32, 8), 6),
    ((128, 8), 4),
    ((512, 8), 2),
]
NARROW = [((4, 4), 8), ((8, 2), 6), ((16, 4), 6), ((32, 2), 4), ((64, 1), 3), ((256, 4), 2)]
TARGETS = {"p99_ms_up_to_64_gpus": 2.0, "p99_ms_4096_gpus": 20.0, "single_node_per_s": 5000.0}


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def make_nodes():
    names = [f"n{i:04d}" for i in range(NODES)]
    fabric = default_fabric(names, nodes_per_leaf=PER_LEAF, leaves_per_spine=LEAVES_PER_SPINE)
    return fabric, [NodeCapacity(n, GPUS, set(range(GPUS)), True, fabric.path(n)) for n in names]


# ---- the naive full-scan placer ------------------------------------------------------------------------------


class NaivePlacer:
    """Same objective as phalanx.core.placement.place_gang, computed by scanning every node at every tier."""

    def __init__(self, nodes: list[NodeCapacity], tiers) -> None:
        self.nodes = nodes
        self.by_name = {n.name: n for n in nodes}
        self.top = max(len(n.path) for n in nodes) + 1
        self.names = ["node", *list(tiers)[: self.top - 1], "cluster"]
        self.largest = max(n.total for n in nodes)

    def place(self, request: GangRequest) -> Placement | Unplaceable:
        g, need = request.gpus_per_replica, request.replicas
        total = sum((len(n.free) // g) for n in self.nodes if n.schedulable)
        if total < need:
            return Unplaceable(request.job_id, "does not fit")
        for level in range(self.top + 1):
            if level == 0:
                # Fewest free GPUs, then (fragmentation) the fullest leaf, then the leaf's name, then the node's.
                leaf_free: dict[str, int] = {}
                for n in self.nodes:
                    leaf_free[n.path[0]] = leaf_free.get(n.path[0], 0) + (len(n.free) if n.schedulable else 0)
                best = None
                for n in self.nodes:
                    f = len(n.free) if n.schedulable else 0
                    if f < need * g:
                        continue
                    key = (f, leaf_free[n.path[0]], n.path[0], n.name)
                    if best is None or key < best[0]:
                        best = (key, n)
                if best is not None:
                    return _build(request, [(best[1], need)], self.names, 0)
                continue
            stats: dict[str, list[int]] = {}
            for n in self.nodes:
                f = len(n.free) if n.schedulable else 0
                s = stats.setdefault(domain_key(n, level, self.top), [0, 0])
                s[0] += f // g
                s[1] += f
            fitting = [k for k, (slots, _) in stats.items() if slots >= need]
            if not fitting:
                continue
            # Fewest children, then fewest domains of each level below, then best fit: scan every node for each
            # fitting domain's members and rank it by the cost of its cheapest placement (the scan version).
            members: dict[str, list[NodeCapacity]] = {}
            for n in self.nodes:
                k = domain_key(n, level, self.top)
                if k in stats and stats[k][0] >= need and n.schedulable and len(n.free) >= g:
                    members.setdefault(k, []).append(n)
            if len(fitting) == 1:
                key = fitting[0]
            else:
                key = min(fitting, key=lambda k: (_scan_cost(members[k], need, g, level), stats[k][1], k))
            members = [
                n for n in self.nodes if domain_key(n, level, self.top) == key and n.schedulable and len(n.free) >= g
            ]
            return _build(request, _take(members, need, g, level), self.names, level)
        return Unplaceable(request.job_id, "does not fit")

    def reserve(self, placement: Placement) -> None:
        for rep in placement.replicas:
            self.by_name[rep.node].free -= set(rep.gpus)

    def release(self, placement: Placement) -> None:
        for rep in placement.replicas:
            self.by_name[rep.node].free |= set(rep.gpus)


# ---- the run -------------------------------------------------------------------------------------------------


def run_core(decisions: int, retries: int, seed: int, mix: list = SHAPES):
    fabric, nodes = make_nodes()
    tracemalloc.start()
    cap = ClusterCapacity(nodes)
    cap.levels()  # build the index
    _, index_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rng = random.Random(seed)
    shapes, weights = zip(*mix, strict=True)
    total = cap.total_gpus()
    held: dict[str, Placement] = {}
    ops: list[tuple] = []
    lat: dict[int, list[float]] = {}
    lat_placed: dict[int, list[float]] = {}
    utils: list[float] = []
    placed = failed = 0
    job = 0

    def release_random() -> None:
        if not held:
            return
        victim = rng.choice(list(held))
        p = held.pop(victim)
        for rep in p.replicas:
            cap.release(rep.node, rep.gpus)
        ops.append(("release", victim))

    n = 0
    while n < decisions:
        replicas, g = rng.choices(shapes, weights)[0]
        job += 1
        request = GangRequest(f"j{job}", replicas, g)
        for _attempt in range(retries + 1):
            if n >= decisions:
                break
            t0 = time.perf_counter()
            result = place_gang(cap, request, fabric.tiers)
            if not isinstance(result, Unplaceable):
                cap.reserve(result)
            dt = time.perf_counter() - t0
            n += 1
            ops.append(("place", request))
            lat.setdefault(request.gpus, []).append(dt)
            if isinstance(result, Unplaceable):
                failed += 1
                release_random()
                continue
            placed += 1
            lat_placed.setdefault(request.gpus, []).append(dt)
            held[request.job_id] = result
            while total - cap.free_gpus() > 0.9 * total:
                release_random()
            break
        utils.append(1 - cap.free_gpus() / total)
    return ops, lat, lat_placed, placed, failed, utils, index_peak, {k: v for k, v in held.items()}


def run_naive(ops: list[tuple], limit: int):
    fabric, nodes = make_nodes()
    naive = NaivePlacer(nodes, fabric.tiers)
    # the core again, on its own copy, to compare decisions one by one
    _, core_nodes = make_nodes()
    cap = ClusterCapacity(core_nodes)
    held_naive: dict[str, Placement] = {}
    held_core: dict[str, Placement] = {}
    lat: dict[int, list[float]] = {}
    agree = disagree = n = 0
    for op in ops:
        if op[0] == "release":
            for held, free in ((held_naive, naive.release), (held_core, None)):
                p = held.pop(op[1], None)
                if p is not None:
                    if free is not None:
                        free(p)
                    else:
                        for rep in p.replicas:
                            cap.release(rep.node, rep.gpus)
            continue
        if n >= limit:
            break
        request = op[1]
        t0 = time.perf_counter()
        result = naive.place(request)
        if not isinstance(result, Unplaceable):
            naive.reserve(result)
        dt = time.perf_counter() - t0
        n += 1
        lat.setdefault(request.gpus, []).append(dt)
        core = place_gang(cap, request, fabric.tiers)
        if not isinstance(core, Unplaceable):
            cap.reserve(core)
            held_core[request.job_id] = core
        if not isinstance(result, Unplaceable):
            held_naive[request.job_id] = result
        same = (isinstance(core, Unplaceable) and isinstance(result, Unplaceable)) or (
            isinstance(core, Placement) and isinstance(result, Placement) and core.replicas == result.replicas
        )
        agree += same
        disagree += not same
    return lat, n, agree, disagree


def summarize(lat: dict[int, list[float]]) -> dict[str, dict[str, float]]:
    return {
        str(gpus): {
            "n": len(v),
            "p50_ms": round(pct(v, 50) * 1e3, 4),
            "p99_ms": round(pct(v, 99) * 1e3, 4),
            "max_ms": round(max(v) * 1e3, 4),
        }
        for gpus, v in sorted(lat.items())
    }


def rates(lat: dict[int, list[float]]) -> tuple[float, float]:
    every = [x for v in lat.values() for x in v]
    single = [x for gpus, v in lat.items() if gpus <= GPUS for x in v]
    return len(every) / sum(every), (len(single) / sum(single) if single else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--naive-decisions", type=int, default=2000)
    ap.add_argument("--retries", type=int, default=40, help="attempts per gang after a failure (each one releases)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2,000 decisions, 300 for the naive placer")
    ap.add_argument(
        "--mix",
        choices=["default", "narrow"],
        default="default",
        help="narrow: also multi-node gangs of fewer than 8 GPUs per replica",
    )
    args = ap.parse_args()
    if args.quick:
        args.decisions, args.naive_decisions = 2000, 300

    say(
        f"fabric: {NODES} nodes x {GPUS} GPUs, {NODES // PER_LEAF} leaves of {PER_LEAF}, "
        f"{NODES // PER_LEAF // LEAVES_PER_SPINE} spines of {LEAVES_PER_SPINE} leaves"
    )
    ops, lat, lat_placed, placed, failed, utils, index_peak, _ = run_core(
        args.decisions, args.retries, args.seed, SHAPES + NARROW if args.mix == "narrow" else SHAPES
    )
    per_s, single_per_s = rates(lat)
    core = {
        "decisions": placed + failed,
        "placed": placed,
        "failed": failed,
        "decisions_per_s": round(per_s),
        "single_node_per_s": round(single_per_s),
        "all": summarize(lat),
        "placed_only": summarize(lat_placed),
        "utilization_mean": round(sum(utils) / len(utils), 3),
        "utilization_p10_p90": [round(pct(utils, 10), 3), round(pct(utils, 90), 3)],
        "index_build_peak_bytes": index_peak,
    }
    say(
        f"core: {core['decisions']} decisions ({placed} placed, {failed} failed), {per_s:,.0f} decisions/s, "
        f"{single_per_s:,.0f} single-node decisions/s, utilization mean {core['utilization_mean']:.0%} "
        f"(p10 {core['utilization_p10_p90'][0]:.0%}, p90 {core['utilization_p10_p90'][1]:.0%}); "
        f"index build peak {index_peak / 2**20:.1f} MiB"
    )
    for gpus, s in core["all"].items():
        pl = core["placed_only"].get(gpus, {})
        say(
            f"  core {gpus:>5} GPUs: n={s['n']:>6} p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms  "
            f"max {s['max_ms']:.3f} ms   placed-only p99 {pl.get('p99_ms', float('nan')):.3f} ms (n={pl.get('n', 0)})"
        )

    nlat, nn, agree, disagree = run_naive(ops, args.naive_decisions)
    nper_s, nsingle = rates(nlat)
    naive = {
        "decisions": nn,
        "decisions_per_s": round(nper_s),
        "single_node_per_s": round(nsingle),
        "all": summarize(nlat),
        "agree_with_core": agree,
        "disagree_with_core": disagree,
    }
    say(
        f"naive full scan: {nn} decisions, {nper_s:,.0f} decisions/s, {nsingle:,.0f} single-node decisions/s; "
        f"same choice as the core in {agree}/{nn}"
    )
    for gpus, s in naive["all"].items():
        c = core["all"].get(gpus, {})
        say(
            f"  naive {gpus:>5} GPUs: n={s['n']:>6} p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms   "
            f"(core p99 {c.get('p99_ms', float('nan')):.3f} ms)"
        )

    up_to_64 = max((s["p99_ms"] for g, s in core["all"].items() if int(g) <= 64), default=float("nan"))
    big = core["all"].get("4096", {}).get("p99_ms", float("nan"))
    big_placed = core["placed_only"].get("4096", {}).get("p99_ms", float("nan"))
    checks = {
        "p99_ms_up_to_64_gpus": [up_to_64, TARGETS["p99_ms_up_to_64_gpus"], up_to_64 < TARGETS["p99_ms_up_to_64_gpus"]],
        "p99_ms_4096_gpus": [big, TARGETS["p99_ms_4096_gpus"], big < TARGETS["p99_ms_4096_gpus"]],
        "p99_ms_4096_gpus_placed": [big_placed, TARGETS["p99_ms_4096_gpus"], big_placed < TARGETS["p99_ms_4096_gpus"]],
        "single_node_per_s": [
            core["single_node_per_s"],
            TARGETS["single_node_per_s"],
            core["single_node_per_s"] > TARGETS["single_node_per_s"],
        ],
    }
    for name, (got, want, ok) in checks.items():
        say(f"target {name}: {got} vs {want}: {'met' if ok else 'MISSED'}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    say(f"max RSS {rss / 1024:.0f} MiB")
    print(
        json.dumps(
            {"core": core, "naive": naive, "targets": checks, "max_rss_kib": rss, "python": sys.version.split()[0]}
        )
    )


if __name__ == "__main__":
    main()
