"""The long run of the randomized invariant checker (issue 30): seeded scenarios through the decision core in the
model world (phalanx.testing.world), every invariant of phalanx.core.invariants asserted after every step.

    .venv/bin/python bench/invariants.py [--scenarios 100000] [--workers 2] [--baseline 5000] [--seed 0]

Each scenario: 2 to 32 nodes of mixed fabrics (leaves, NVLink domains, two GPU models, MIG GPUs), half of them
starting full of long low-priority gangs, then 1 to 40 random actions (submits of 1-64 GPU gangs, whole or partial,
with and without time limits, in queues with a cohort or none; time; releases confirmed late and out of order;
checkpoints committing early, late or never; rank failures, node deaths and returns, GPU failures, MIG mode
switches, cancels), then a quiet drain to the end (liveness). A failure is shrunk to a minimal scenario and printed
in the regression table's language (tests/unit/test_invariant_regressions.py).

The baseline, in the same run: the first `--baseline` scenarios again with claims turned off (the decision before
this issue), to show what the checker finds there. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.testing.world import format_actions, random_scenario, run, shrink

# A scenario that has not ended after this many seconds is counted as a liveness violation ("no end"): without
# claims a preemption cycle can go on for good (the baseline met one that ran for an hour and grew to 8 GB).
SCENARIO_LIMIT_S = 60


class _NoEnd(Exception):
    pass


def _no_end(*_: object) -> None:
    raise _NoEnd


def play(args: tuple[int, bool]) -> tuple[int, int, int, str, str]:
    """(seed, decisions, events, first violation's invariant or "", its text)."""
    seed, claims = args
    signal.signal(signal.SIGALRM, _no_end)
    signal.alarm(SCENARIO_LIMIT_S)
    try:
        world = run(random_scenario(random.Random(seed)), claims=claims)
    except _NoEnd:
        return seed, 0, 0, "d", f"(d) seed {seed}: no end within {SCENARIO_LIMIT_S} s (a cycle that never settles)"
    finally:
        signal.alarm(0)
    found = world.violations[0] if world.violations else None
    return seed, world.decisions, len(world.history), found.invariant if found else "", str(found) if found else ""


def sweep(seeds: range, claims: bool, workers: int, label: str) -> dict:
    start = time.perf_counter()
    found: Counter[str] = Counter()
    first: dict[str, int] = {}
    decisions = events = done = 0
    with multiprocessing.Pool(workers, maxtasksperchild=500) as pool:
        for seed, d, e, invariant, _ in pool.imap_unordered(play, ((s, claims) for s in seeds), chunksize=20):
            done += 1
            decisions += d
            events += e
            if invariant:
                found[invariant] += 1
                first.setdefault(invariant, seed)
            if done % 5000 == 0 or done == len(seeds):
                rate = done / (time.perf_counter() - start)
                print(
                    f"  {label}: {done:,}/{len(seeds):,} scenarios, {decisions:,} decisions, "
                    f"{sum(found.values())} with a violation ({rate:.0f} scenarios/s)",
                    flush=True,
                )
    return dict(
        scenarios=len(seeds),
        decisions=decisions,
        events=events,
        violating_scenarios=sum(found.values()),
        by_invariant=dict(sorted(found.items())),
        first_seed=first,
        seconds=round(time.perf_counter() - start, 1),
    )


def show_minimal(seed: int, claims: bool) -> str:
    scenario = random_scenario(random.Random(seed))
    signal.signal(signal.SIGALRM, _no_end)
    signal.alarm(SCENARIO_LIMIT_S)
    try:
        want = run(scenario, claims=claims).violations[0].invariant
    except _NoEnd:
        return f"seed {seed}: no end within {SCENARIO_LIMIT_S} s (not shrunk)"
    finally:
        signal.alarm(0)

    def fails(s):  # type: ignore[no-untyped-def]
        v = run(s, claims=claims).violations
        return bool(v) and v[0].invariant == want

    small = shrink(scenario, fails)
    violation = run(small, claims=claims).violations[0]
    return (
        f"seed {seed}, shrunk: {small.cluster}, queues {[q.name for q in small.queues]}, min runtime "
        f"{small.min_runtime_s:g}s, grace {small.grace_s:g}s\n{format_actions(small.actions)}\n-> {violation}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=max(1, min(4, multiprocessing.cpu_count())))
    ap.add_argument("--baseline", type=int, default=5_000, help="scenarios run again with claims off (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    args = ap.parse_args(argv)

    print(f"invariant checker: {args.scenarios:,} scenarios from seed {args.seed}, {args.workers} worker(s)")
    claims = sweep(range(args.seed, args.seed + args.scenarios), True, args.workers, "claims on")
    for invariant, seed in sorted(claims["first_seed"].items()):
        print(f"  ({invariant}) first found at {show_minimal(seed, True)}")
    baseline = None
    if args.baseline:
        print(f"baseline: the first {args.baseline:,} scenarios with claims off (the decision before issue 30)")
        baseline = sweep(range(args.seed, args.seed + args.baseline), False, args.workers, "claims off")
        for invariant, seed in sorted(baseline["first_seed"].items()):
            print(f"  ({invariant}) first found at {show_minimal(seed, False)}")
    print(
        f"claims on: {claims['violating_scenarios']} violating scenario(s) of {claims['scenarios']:,} "
        f"({claims['decisions']:,} decisions, {claims['seconds']:g} s)"
        + (
            f"; claims off: {baseline['violating_scenarios']} of {baseline['scenarios']:,} ({baseline['by_invariant']})"
            if baseline
            else ""
        )
    )
    print(json.dumps({"bench": "invariants", "claims_on": claims, "claims_off": baseline}, sort_keys=True))
    return 1 if claims["violating_scenarios"] else 0


if __name__ == "__main__":
    sys.exit(main())
