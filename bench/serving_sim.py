"""Serving next to training, simulated: the figures of `phalanx sim serving`, and how long the replays take.

An autoscaled LLM-serving fleet (replicas of 2 x 8 GPUs, scaled by `phalanx.core.autoscale.recommend` on a diurnal
load whose defaults come from the Azure LLM inference trace 2024) runs beside a training trace resampled from the
Philly-derived trace (or a synthetic Philly-like mix: --synthetic, or when the data folder is missing), on --nodes
nodes for --hours, under the three policies of `phalanx.sim.serving` (static-split, preempt,
preempt-checkpoint-backfill), every placement and preemption through `phalanx.core.decide`. The settings are
`phalanx.sim.serving_eval.ServingEval`'s defaults unless given; docs/evaluation.md has the method and the sources.

Checks (exit 1 when one fails; --no-targets: only print):
- serving keeps its SLO proxy (enough ready capacity for the offered load) at least 99% of the time under every
  policy, and the preemption policies have at least the static split's ready replicas at every daily peak;
- the static split never preempts;
- the checkpoint handshake loses fewer training GPU-hours to preemption than plain preemption.

Run: .venv/bin/python bench/serving_sim.py [--nodes 64] [--hours 72] [--seed 0] [--peak-trough 2]
     [--min-runtime 0] [--synthetic] [--quick] [--no-targets]
Progress goes to stderr; the table to stdout, whose last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phalanx.sim.serving import PREEMPT, PREEMPT_CHECKPOINT_BACKFILL, SERVING_POLICIES, STATIC_SPLIT
from phalanx.sim.serving_eval import ServingEval, markdown, run_eval
from phalanx.sim.traces import DataNotFound


def say(line: str) -> None:
    print(f"[serving] {line}", file=sys.stderr, flush=True)


def checks(policies: dict) -> dict[str, bool]:
    static = policies[STATIC_SPLIT]
    out = {
        "slo_99_every_policy": all(m["serving"]["slo_time_share"] >= 0.99 for m in policies.values()),
        "static_split_never_preempts": static["training"]["preemptions"] == 0,
        "handshake_loses_less_than_plain_preemption": policies[PREEMPT_CHECKPOINT_BACKFILL]["training"][
            "preempt_lost_gpu_hours"
        ]
        < policies[PREEMPT]["training"]["preempt_lost_gpu_hours"],
    }
    for name in (PREEMPT, PREEMPT_CHECKPOINT_BACKFILL):
        ready, base = policies[name]["serving"]["ready_at_peaks"], static["serving"]["ready_at_peaks"]
        out[f"{name}_ready_at_peaks_ge_static"] = all(a >= b for a, b in zip(ready, base, strict=True))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=64, help="nodes of 8 GPUs, leaves of 8")
    ap.add_argument("--hours", type=float, default=72.0, help="the window replayed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-trough", type=float, default=None, help="the load's peak over trough (default: 2)")
    ap.add_argument("--min-runtime", type=float, default=None, help="seconds a training gang is protected (0)")
    ap.add_argument("--synthetic", action="store_true", help="a synthetic Philly-like training mix (no data)")
    ap.add_argument("--data", default=None, help="the data folder (default: $PHALANX_DATA, then ../shared/data)")
    ap.add_argument("--quick", action="store_true", help="16 nodes, 24 hours, the synthetic mix")
    ap.add_argument("--no-targets", action="store_true", help="only print the checks; exit 0 even when one fails")
    args = ap.parse_args()
    settings: dict = {"nodes": args.nodes, "hours": args.hours, "seed": args.seed}
    if args.peak_trough is not None:
        settings["peak_to_trough"] = args.peak_trough
    if args.min_runtime is not None:
        settings["min_runtime_s"] = args.min_runtime
    if args.synthetic or args.quick:
        settings["trace"] = "synthetic"
    if args.quick:
        settings |= {"nodes": 16, "hours": 24.0}
    ev = ServingEval(**settings)
    started = time.perf_counter()
    try:
        doc, results, _ = run_eval(ev, args.data, say)
    except DataNotFound as exc:
        say(f"no trace data ({exc}); the synthetic Philly-like mix instead")
        ev = ServingEval(**(settings | {"trace": "synthetic"}))
        doc, results, _ = run_eval(ev, args.data, say)
    wall = time.perf_counter() - started
    print(markdown(doc))
    for r in results:
        m = r.metrics
        print(
            f"{r.policy}: replayed in {m['wall_s']:.1f} s ({m['scheduling_passes']:,} decisions, "
            f"{m['scheduling_passes'] / max(m['wall_s'], 1e-9):,.0f} per second)"
        )
    verdict = checks(doc["policies"])
    for name, ok in verdict.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    summary = {
        "settings": doc["settings"],
        "load": doc["load"],
        "serve_pool_nodes": doc["serve_pool_nodes"],
        "training_jobs": doc["training_jobs"],
        "training_source": doc["training_source"],
        "policies": {
            p: {
                "serving_replica_hours": m["serving"]["replica_hours"],
                "serving_slo_time_share": m["serving"]["slo_time_share"],
                "serving_ready_at_peaks": m["serving"]["ready_at_peaks"],
                "serving_placement_delay_mean_s": m["serving"]["placement_delay_mean_s"],
                "training_goodput": m["training"]["goodput"],
                "training_gpu_hours_productive": m["training"]["gpu_hours_productive"],
                "training_preempt_lost_gpu_hours": m["training"]["preempt_lost_gpu_hours"],
                "training_preemptions": m["training"]["preemptions"],
                "training_jct_mean_h": m["training"]["jct_mean_h"],
                "training_queue_delay_mean_h": m["training"]["queue_delay_mean_h"],
                "utilization": m["utilization"],
                "wall_s": m["wall_s"],
            }
            for p, m in doc["policies"].items()
            if p in SERVING_POLICIES
        },
        "checks": verdict,
        "wall_s": wall,
    }
    print(json.dumps(summary, default=float), flush=True)
    return 0 if args.no_targets or all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
