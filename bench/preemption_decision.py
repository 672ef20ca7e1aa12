"""Latency and quality of the pure preemption decision (`phalanx.core.preemption.choose_victims`) on a full cluster.

The cluster: 512 nodes x 8 GPUs on a two-tier fat-tree (16 nodes per leaf, 8 leaves per spine), filled by running
gangs of mixed sizes (1x1, 1x2, 1x4, 1x8, 2x8, 4x8, 8x8 GPUs) and priorities (-100, 0, 100) placed through
place_gang + reserve: filled to 95%, churned (one random gang leaves, arrivals refill to 95%, once per node), filled
to the brim, then small gangs (under 8 GPUs) finish until it is at 95% again, so the free GPUs lie in a few whole
nodes and in holes on partly used ones. Each running gang has a random amount of work since its last checkpoint
(0-1,800) and a start time up to an hour ago: the ones that started less than `min_runtime_s` (600 s) ago (about
one in six) are protected. --states such states are built, each from its own seed.

Then pending gangs of priority 100 or 200 (1x8, 4x8, 8x8 and 16x8 GPUs; some with required_tier="leaf") ask for
victims, --cases of them spread over the states. Every case of a state is decided on that same state (the
decision never changes it), timed with time.perf_counter around the whole call.

Baseline (same cases, same state): a naive victim search. The same admissible candidates in the same cost order
(lowest priority, then least work since checkpoint, then job id), released one at a time on a copy of the capacity,
with place_gang after each release until the gang fits: no binary search, no pruning, no locality. choose_victims
takes the shortest such prefix and then prunes it, so it must never evict more than the baseline.

Each search is timed --repeat times (default 3) and the fastest kept, which takes out most of a shared machine's
noise. Both searches start from a fresh copy of the capacity view (whose index place_gang rebuilds), so that cost is
in both figures.

Checks, on every case (each count must be 0):
- after releasing exactly choose_victims' victims on a copy, place_gang succeeds and its returned placement can be
  reserved there;
- every victim has a priority strictly lower than the pending gang's and is past its minimum runtime;
- choose_victims and the baseline agree on whether some preemption exists (and on "fits without preemption");
- choose_victims never evicts more gangs than the baseline.

Run: .venv/bin/python bench/preemption_decision.py [--cases 1000] [--states 4] [--nodes 512] [--repeat 3] [--quick]
     [--no-targets]
Progress goes to stderr; the figures to stdout, whose last line is one JSON object with every figure. Exit 1 when a
check fails (--no-targets: only print).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phalanx.core.capacity import CapacityError, ClusterCapacity
from phalanx.core.fabric import default_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import place_gang
from phalanx.core.preemption import (
    NoPreemption,
    Preemption,
    PreemptionPolicy,
    RunningGang,
    choose_victims,
)

GPUS, PER_LEAF, LEAVES_PER_SPINE = 8, 16, 8
FILL = 0.95
POLICY = PreemptionPolicy(min_runtime_s=600.0, grace_period_s=120.0)
NOW = 1_000_000.0
# running gangs: (replicas, GPUs per replica) and how often each arrives; priorities and their weights
RUNNING_SHAPES = [((1, 1), 20), ((1, 2), 12), ((1, 4), 12), ((1, 8), 20), ((2, 8), 14), ((4, 8), 12), ((8, 8), 10)]
RUNNING_PRIORITIES = [(-100, 30), (0, 50), (100, 20)]
# pending gangs: (replicas, GPUs per replica, required_tier) and how often each arrives; priorities and weights
PENDING_SHAPES = [
    ((1, 8, ""), 25),
    ((4, 8, ""), 20),
    ((4, 8, "leaf"), 10),
    ((8, 8, ""), 15),
    ((8, 8, "leaf"), 10),
    ((16, 8, ""), 15),
    ((16, 8, "leaf"), 5),
]
PENDING_PRIORITIES = [(100, 70), (200, 30)]


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def copy_capacity(capacity: ClusterCapacity) -> ClusterCapacity:
    return ClusterCapacity(
        dataclasses.replace(n, free=set(n.free), mig=dict(n.mig), milli=dict(n.milli)) for n in capacity.nodes.values()
    )


# ---- the cluster state -------------------------------------------------------------------------------------------


def build_state(nodes: int, churn: int, seed: int):
    """A capacity view ~95% full of running gangs, after `churn` departures, and the gangs (RunningGang each)."""
    names = [f"n{i:04d}" for i in range(nodes)]
    fabric = default_fabric(names, nodes_per_leaf=PER_LEAF, leaves_per_spine=LEAVES_PER_SPINE)
    cap = ClusterCapacity(NodeCapacity(n, GPUS, set(range(GPUS)), True, fabric.path(n)) for n in names)
    rng = random.Random(seed)
    shapes, sw = zip(*RUNNING_SHAPES, strict=True)
    prios, pw = zip(*RUNNING_PRIORITIES, strict=True)
    total = cap.total_gpus()
    running: dict[str, RunningGang] = {}
    job = 0

    def fill_to(level: float) -> None:
        nonlocal job
        misses = 0
        while total - cap.free_gpus() < level * total and misses < 200:
            replicas, g = rng.choices(shapes, sw)[0]
            job += 1
            request = GangRequest(f"r{job:05d}", replicas, g)
            got = place_gang(cap, request, fabric.tiers)
            if not isinstance(got, Placement):
                misses += 1
                continue
            cap.reserve(got)
            # started up to an hour ago: about 1 in 6 is still within its 600 s minimum runtime
            running[request.job_id] = RunningGang(
                request.job_id,
                rng.choices(prios, pw)[0],
                got,
                started_at=NOW - rng.uniform(0, 3600),
                work_since_checkpoint=round(rng.uniform(0, 1800), 1),
            )

    def fill() -> None:
        fill_to(FILL)

    fill()
    # Churn: random gangs leave and arrivals refill the cluster to 95%; best fit packs the arrivals into the
    # fullest nodes, so the free GPUs end up in whole nodes and in holes left by departures.
    for _ in range(churn):
        gone = running.pop(rng.choice(list(running)))
        cap.release_placement(gone.placement)
        fill()
    # Then the last arrivals fill every hole they can (as a backlog of low-priority work would), and small gangs
    # (under 8 GPUs) finish until utilization is back at 95%: the free GPUs are scattered over partly used nodes.
    fill_to(1.0)
    small = [j for j, g in running.items() if sum(len(r.gpus) for r in g.placement.replicas) < GPUS]
    rng.shuffle(small)
    while total - cap.free_gpus() > FILL * total and small:
        cap.release_placement(running.pop(small.pop()).placement)
    return fabric, cap, list(running.values())


def make_cases(count: int, seed: int) -> list[GangRequest]:
    rng = random.Random(seed * 7919 + 1)
    shapes, sw = zip(*PENDING_SHAPES, strict=True)
    prios, pw = zip(*PENDING_PRIORITIES, strict=True)
    cases = []
    for i in range(count):
        replicas, g, tier = rng.choices(shapes, sw)[0]
        cases.append(GangRequest(f"p{i:05d}", replicas, g, priority=rng.choices(prios, pw)[0], required_tier=tier))
    return cases


# ---- the naive victim search -------------------------------------------------------------------------------------


def naive_victims(capacity: ClusterCapacity, pending: GangRequest, running: list[RunningGang], tiers):
    """("fits", ()) when no preemption is needed, ("preempt", victims) with the greedy prefix, or ("none", ())."""
    if isinstance(place_gang(capacity, pending, tiers), Placement):
        return "fits", ()
    candidates = sorted(
        (
            g
            for g in running
            if g.priority < pending.priority and g.placement.replicas and NOW - g.started_at >= POLICY.min_runtime_s
        ),
        key=lambda g: (g.priority, g.work_since_checkpoint, g.job_id),
    )
    work = copy_capacity(capacity)
    for k, gang in enumerate(candidates):
        work.release_placement(gang.placement)
        if isinstance(place_gang(work, pending, tiers), Placement):
            return "preempt", tuple(candidates[: k + 1])
    return "none", ()


# ---- the run -----------------------------------------------------------------------------------------------------


def check(
    capacity: ClusterCapacity, pending: GangRequest, decision: Preemption, by_id: dict[str, RunningGang], tiers
) -> list[str]:
    problems = []
    work = copy_capacity(capacity)
    for vid in decision.victims:
        gang = by_id.get(vid)
        if gang is None:
            problems.append(f"{pending.job_id}: unknown victim {vid}")
            continue
        if gang.priority >= pending.priority:
            problems.append(f"{pending.job_id}: victim {vid} has priority {gang.priority} >= {pending.priority}")
        if NOW - gang.started_at < POLICY.min_runtime_s:
            problems.append(f"{pending.job_id}: victim {vid} is protected ({NOW - gang.started_at:.0f} s old)")
        work.release_placement(gang.placement)
    if len(set(decision.victims)) != len(decision.victims):
        problems.append(f"{pending.job_id}: a victim is named twice")
    if not isinstance(place_gang(work, pending, tiers), Placement):
        problems.append(f"{pending.job_id}: place_gang fails after releasing exactly the victims")
    try:
        work.reserve(decision.placement)
    except CapacityError as exc:
        problems.append(f"{pending.job_id}: the returned placement cannot be reserved after the release: {exc}")
    return problems


def gpus_of(gang: RunningGang) -> int:
    return sum(len(r.gpus) for r in gang.placement.replicas)


def lat(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(pct(values, 50) * 1e3, 3),
        "p99_ms": round(pct(values, 99) * 1e3, 3),
        "max_ms": round(max(values) * 1e3, 3) if values else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=512, help="nodes of 8 GPUs (a multiple of 16 keeps leaves whole)")
    ap.add_argument("--states", type=int, default=4, help="cluster states (each filled and churned from its own seed)")
    ap.add_argument("--cases", type=int, default=1000, help="pending gangs to decide, spread over the states")
    ap.add_argument(
        "--churn",
        type=int,
        default=None,
        help="departures (each refilled) after the first fill; default: as many as nodes",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="time each search this many times and keep the fastest "
        "(the machine's noise, not the search, makes the slow ones)",
    )
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 states, 200 cases, 1 timing")
    ap.add_argument("--no-targets", action="store_true", help="only print the checks; exit 0 even when one fails")
    args = ap.parse_args()
    if args.quick:
        args.states, args.cases, args.repeat = 2, 200, 1
    churn = args.nodes if args.churn is None else args.churn

    lat_cv: list[float] = []
    lat_nv: list[float] = []
    lat_cv_pre: list[float] = []  # only the cases where choose_victims found a preemption
    lat_nv_pre: list[float] = []  # only the cases where the naive search found one
    by_size: dict[str, list[float]] = {}
    outcome = {"preempt": 0, "fits": 0, "none": 0}
    pairs: list[tuple[int, int, float, int, int, float]] = []  # victims, GPUs, work lost: choose_victims then naive
    mismatches: list[str] = []
    violations: list[str] = []
    states = []
    t_all = time.perf_counter()
    per_state = [args.cases // args.states + (k < args.cases % args.states) for k in range(args.states)]
    for k in range(args.states):
        t0 = time.perf_counter()
        fabric, cap, running = build_state(args.nodes, churn, args.seed + 1000 * k)
        tiers, total = fabric.tiers, cap.total_gpus()
        state = {
            "running_gangs": len(running),
            "protected": sum(NOW - g.started_at < POLICY.min_runtime_s for g in running),
            "by_priority": {p: sum(g.priority == p for g in running) for p, _ in RUNNING_PRIORITIES},
            "utilization": round(1 - cap.free_gpus() / total, 4),
            "whole_free_nodes": sum(len(n.free) == GPUS for n in cap.nodes.values()),
            "partly_free_nodes": sum(0 < len(n.free) < GPUS for n in cap.nodes.values()),
        }
        states.append(state)
        say(
            f"state {k}: {args.nodes} nodes x {GPUS} GPUs, {args.nodes // PER_LEAF} leaves of {PER_LEAF}; "
            f"{state['running_gangs']} running gangs ({state['protected']} protected), utilization "
            f"{state['utilization']:.1%}, {state['whole_free_nodes']} whole free nodes, "
            f"{state['partly_free_nodes']} partly free; built in {time.perf_counter() - t0:.2f} s"
        )
        by_id = {g.job_id: g for g in running}
        for i, pending in enumerate(make_cases(per_state[k], args.seed + 1000 * k)):
            if i and i % 100 == 0:
                say(f"  state {k}: {i}/{per_state[k]} cases, {time.perf_counter() - t_all:.1f} s so far")
            free_before = cap.free_gpus()
            dt_cv = dt_nv = float("inf")
            for _ in range(max(1, args.repeat)):
                t = time.perf_counter()
                decision = choose_victims(cap, pending, running, NOW, POLICY, tiers)
                dt_cv = min(dt_cv, time.perf_counter() - t)
                t = time.perf_counter()
                kind, naive = naive_victims(cap, pending, running, tiers)
                dt_nv = min(dt_nv, time.perf_counter() - t)
            name = f"s{k}/{pending.job_id}"
            if cap.free_gpus() != free_before:
                violations.append(f"{name}: the caller's capacity changed")
            lat_cv.append(dt_cv)
            lat_nv.append(dt_nv)
            label = f"{pending.gpus}{'/leaf' if pending.required_tier else ''}"
            by_size.setdefault(label, []).append(dt_cv)
            if kind == "preempt":
                lat_nv_pre.append(dt_nv)

            if isinstance(decision, Preemption):
                cv_kind = "preempt"
            elif isinstance(decision, NoPreemption) and decision.reason.startswith("it fits without preemption"):
                cv_kind = "fits"
            else:
                cv_kind = "none"
            outcome[cv_kind] += 1
            if cv_kind != kind:
                mismatches.append(
                    f"{name} ({label} GPUs, priority {pending.priority}): choose_victims says "
                    f"{cv_kind}, the naive search {kind}"
                )
            if not isinstance(decision, Preemption):
                continue
            lat_cv_pre.append(dt_cv)
            violations.extend(f"s{k}/{v}" for v in check(cap, pending, decision, by_id, tiers))
            victims = [by_id[v] for v in decision.victims if v in by_id]
            lost = sum(g.work_since_checkpoint for g in victims)
            if abs(lost - decision.work_lost) > 1e-6:
                violations.append(f"{name}: work_lost {decision.work_lost} != the victims' sum {lost}")
            if kind == "preempt":
                pairs.append(
                    (
                        len(victims),
                        sum(map(gpus_of, victims)),
                        lost,
                        len(naive),
                        sum(map(gpus_of, naive)),
                        sum(g.work_since_checkpoint for g in naive),
                    )
                )
                if len(victims) > len(naive):
                    violations.append(
                        f"{name}: choose_victims evicts {len(victims)} gangs, the naive search {len(naive)}"
                    )
    elapsed = time.perf_counter() - t_all
    say(f"{args.cases} cases on {args.states} states (building, both searches and the checks) in {elapsed:.1f} s")

    col = list(zip(*pairs, strict=True)) if pairs else [[] for _ in range(6)]
    fewer = sum(p[0] < p[3] for p in pairs)
    same = sum(p[0] == p[3] for p in pairs)
    fewer_gpus = sum(p[1] < p[4] for p in pairs)
    order = sorted(by_size, key=lambda label: (int(label.split("/")[0]), label))
    result = {
        "cluster": {"nodes": args.nodes, "gpus": args.nodes * GPUS, "nodes_per_leaf": PER_LEAF, "states": states},
        "cases": args.cases,
        "outcomes": outcome,
        "choose_victims": {
            "all": lat(lat_cv),
            "preempting": lat(lat_cv_pre),
            "by_size": {label: lat(by_size[label]) for label in order},
            "mean_victims": round(mean(col[0]), 3),
            "mean_gpus_evicted": round(mean(col[1]), 2),
            "mean_work_lost": round(mean(col[2]), 1),
        },
        "naive": {
            "all": lat(lat_nv),
            "preempting": lat(lat_nv_pre),
            "mean_victims": round(mean(col[3]), 3),
            "mean_gpus_evicted": round(mean(col[4]), 2),
            "mean_work_lost": round(mean(col[5]), 1),
        },
        "compared_cases": len(pairs),
        "fewer_victims_than_naive": fewer,
        "same_victims_as_naive": same,
        "fewer_gpus_than_naive": fewer_gpus,
        "mismatches": len(mismatches),
        "violations": len(violations),
        "repeat": args.repeat,
        "seed": args.seed,
        "elapsed_s": round(elapsed, 2),
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "python": sys.version.split()[0],
    }

    util = mean([st["utilization"] for st in states])
    print(
        f"cluster: {args.nodes} nodes x {GPUS} GPUs ({args.nodes // PER_LEAF} leaves of {PER_LEAF}), {args.states} "
        f"states: mean {mean([st['running_gangs'] for st in states]):.0f} running gangs "
        f"({mean([st['protected'] for st in states]):.0f} protected), utilization {util:.1%}, "
        f"{mean([st['whole_free_nodes'] for st in states]):.1f} whole free nodes"
    )
    print(
        f"cases: {args.cases} pending gangs; choose_victims found a preemption in {outcome['preempt']}, "
        f"{outcome['fits']} fit without one, {outcome['none']} had no admissible set of victims"
    )
    for name, key in (("choose_victims", "choose_victims"), ("naive search  ", "naive")):
        a, p = result[key]["all"], result[key]["preempting"]
        print(
            f"{name}: all cases p50 {a['p50_ms']:.3f} ms  p99 {a['p99_ms']:.3f} ms  max {a['max_ms']:.3f} ms;   "
            f"preempting cases p50 {p['p50_ms']:.3f} ms  p99 {p['p99_ms']:.3f} ms  max {p['max_ms']:.3f} ms"
        )
    for label, st in result["choose_victims"]["by_size"].items():
        print(
            f"  choose_victims {label:>8} GPUs: n={st['n']:>4}  p50 {st['p50_ms']:.3f} ms  "
            f"p99 {st['p99_ms']:.3f} ms  max {st['max_ms']:.3f} ms"
        )
    cv, nv = result["choose_victims"], result["naive"]
    print(
        f"over the {len(pairs)} cases where both preempt: mean victims {cv['mean_victims']:.2f} vs "
        f"{nv['mean_victims']:.2f} (naive), GPUs evicted {cv['mean_gpus_evicted']:.1f} vs "
        f"{nv['mean_gpus_evicted']:.1f}, work lost {cv['mean_work_lost']:.0f} vs {nv['mean_work_lost']:.0f}; "
        f"fewer victims in {fewer}, as many in {same}"
    )
    print(f"mismatches (choose_victims vs naive on whether a preemption exists): {len(mismatches)}")
    for m in mismatches[:20]:
        print(f"  MISMATCH {m}")
    print(f"violations (placement after release, priority, protection, more victims than naive): {len(violations)}")
    for v in violations[:20]:
        print(f"  VIOLATION {v}")
    print(json.dumps(result), flush=True)
    if (mismatches or violations) and not args.no_targets:
        sys.exit(1)


if __name__ == "__main__":
    main()
