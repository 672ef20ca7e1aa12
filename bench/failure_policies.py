"""Four recovery policies under node failures at the Llama 3 rate: the figures of `phalanx sim failures`.

Pre-training gangs (default 4 of 112 nodes of 8 GPUs, 14 days of work each) run on 576 nodes in 32 domains of 18
(a leaf switch stands for an NVLink domain), beside background jobs resampled from the Philly-derived trace
(`../shared/data/`; a synthetic Philly-like mix with --synthetic or without the data) offered at 1.0 of the rest. Nodes fail
as a Poisson process each at 419 interruptions / (54 days x 16,384 GPUs) = 4.74e-4 per GPU-day (Llama 3, Dubey et
al. 2024, section 3.3.4), are down for an exponential repair of mean 4 h, and every policy meets the same failures
(same seed). Recovery goes through `phalanx.core.recovery.decide_recovery`; placement through `phalanx.core.decide`.
The settings are `phalanx.sim.failure_eval.FailureEval`'s defaults unless given; docs/evaluation.md has the method.

Checks (exit 1 when one fails; --no-targets: only print):
- spares+elastic has an ETTR at least requeue's;
- only the spare policies hold spare GPU-hours.

Run: .venv/bin/python bench/failure_policies.py [--failures llama3|llama3xN|RATE] [--seed 0] [--synthetic]
     [--quick] [--jobs 2] [--out bench-failures] [--no-targets]
Progress goes to stderr; the table to stdout, whose last line is one JSON object with every figure. The plot (with
matplotlib) and failures.json/failures.md go to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phalanx.core.recovery import POLICIES
from phalanx.sim.failure_eval import FailureEval, markdown, run_eval, write_outputs
from phalanx.sim.failures import parse_failure_rate


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def one_policy(ev: FailureEval) -> dict:
    return run_eval(ev, say)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--failures", default="llama3", help="llama3 (default), llama3xN, none or a rate per GPU-day")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic", action="store_true", help="a synthetic Philly-like background (no data)")
    ap.add_argument("--data", default=None, help="the data folder (default: $PHALANX_DATA, then ../shared/data)")
    ap.add_argument("--quick", action="store_true", help="96 nodes, 2 gangs of 24 nodes for 4 days, 10x the rate")
    ap.add_argument("--jobs", type=int, default=2, help="policies replayed at once, one process each (default 2)")
    ap.add_argument("--out", default="bench-failures", help="where the plot and the report go")
    ap.add_argument("--no-targets", action="store_true", help="only print the checks; exit 0 even when one fails")
    args = ap.parse_args()
    ev = FailureEval(
        failures_per_gpu_day=parse_failure_rate(args.failures),
        seed=args.seed,
        background="synthetic" if args.synthetic else "auto",
        data=args.data,
    )
    if args.quick:
        ev = dataclasses.replace(
            ev,
            cluster="96x8,leaf=12,spine=8",
            large=2,
            large_nodes=24,
            large_days=4,
            failures_per_gpu_day=10 * ev.failures_per_gpu_day,
        )
    started = time.perf_counter()
    # One process per policy (each replay is single-threaded); the same seed gives every one the same failures.
    singles = [dataclasses.replace(ev, policies=(p,)) for p in POLICIES]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        docs = list(pool.map(one_policy, singles))
    doc = dict(docs[0])
    doc["rows"] = [d["rows"][0] for d in docs]
    doc["results"] = {p: d["results"][p] for p, d in zip(POLICIES, docs, strict=True)}
    doc["wall_s"] = time.perf_counter() - started
    written = write_outputs(doc, Path(args.out))
    say(f"[bench] {doc['source']}; wrote {', '.join(written)} in {args.out}")
    rows = {r["policy"]: r for r in doc["rows"]}
    checks = {
        "spares+elastic ETTR >= requeue ETTR": rows["spares+elastic"]["ettr"] >= rows["requeue"]["ettr"],
        "only spare policies hold spares": all(
            (rows[p]["spare_gpu_hours"] > 0) == ("spares" in p) for p in POLICIES if ev.spares_per_domain
        ),
    }
    print(markdown(doc))
    print()
    for name, ok in checks.items():
        print(f"- {name}: {'ok' if ok else 'FAILED'}")
    summary = {
        "bench": "failure_policies",
        "cluster": doc["cluster"],
        "source": doc["source"],
        "failures_per_gpu_day": doc["failures_per_gpu_day"],
        "seed": doc["seed"],
        "rows": doc["rows"],
        "checks": checks,
        "wall_s": doc["wall_s"],
    }
    print(json.dumps(summary, default=float))
    return 0 if args.no_targets or all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
