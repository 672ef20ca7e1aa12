"""`phalanx sim serving`: the serving-next-to-training evaluation, from its settings to its table, JSON and plot.

:class:`ServingEval` holds the settings (the command's flags); :func:`prepare` makes the load series, the
service and the training jobs; :func:`run_eval` replays each policy (`phalanx.sim.serving`) and returns one
document (settings, what the load turned out to be, every policy's metrics); :func:`markdown` is its table;
:func:`write_outputs` writes `serving.md`, `serving.json` and `serving.png` (the plot needs matplotlib, the `plots`
extra: without it the other two are written and the table says why there is no plot).

How the pieces are sized (all of it seeded, so a run is the same for the same settings):

- The service: replicas of 2 nodes; the load's mean is set so that at the envelope's peak the autoscaler wants
  `serving_share` of the cluster's nodes (0.4 by default).
- The serving pool of the static split (and of preempt-checkpoint-backfill): the nodes the fleet needs at the busiest
  bin the load actually has (`serving.pool_for`).
- Training: jobs resampled from `trace` (`serving_training`), gangs of at most the training pool's GPUs, arriving at
  the rate that offers `training_load` x what serving leaves on average (the cluster's GPUs less the fleet's mean),
  with 6 hours of backlog queued at the start: the cluster starts full.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .cluster import ClusterSpec
from .serving import SERVING_POLICIES, ServingResult, ServingSetup, ServingSpec, pool_for, simulate_serving
from .serving_load import (
    AZURE_CONVERSATION_PEAK_TO_TROUGH,
    DEFAULT_ARRIVAL_CV,
    DiurnalLoad,
    LoadSeries,
    load_series,
)
from .serving_training import pool_from_trace, resample_training, synthetic_pool
from .trace_records import TraceJob

PLOT = "serving.png"


@dataclass(frozen=True)
class ServingEval:
    """The evaluation's settings (the flags of `phalanx sim serving`)."""

    nodes: int = 64
    hours: float = 72.0
    seed: int = 0
    gpus_per_node: int = 8
    nodes_per_leaf: int = 8
    serving_share: float = 0.4
    peak_to_trough: float = AZURE_CONVERSATION_PEAK_TO_TROUGH
    arrival_cv: float = DEFAULT_ARRIVAL_CV
    training_load: float = 1.0
    trace: str = "philly"  # a `phalanx sim run --trace` spec, or "synthetic"
    min_runtime_s: float = 0.0
    startup_s: float = 600.0
    policies: tuple[str, ...] = SERVING_POLICIES

    def problems(self) -> list[str]:
        """What is wrong with the settings, in words (empty: nothing)."""
        out = []
        if self.nodes < 4:
            out.append(f"--nodes must be at least 4, not {self.nodes}")
        if not (self.hours > 0 and math.isfinite(self.hours)):
            out.append(f"--hours must be a positive number, not {self.hours}")
        if not 0 < self.serving_share < 1:
            out.append(f"--serving-share must be between 0 and 1, not {self.serving_share}")
        if not (self.peak_to_trough >= 1 and math.isfinite(self.peak_to_trough)):
            out.append(f"--peak-trough must be at least 1, not {self.peak_to_trough}")
        if not (self.arrival_cv > 0 and math.isfinite(self.arrival_cv)):
            out.append(f"--arrival-cv must be positive, not {self.arrival_cv}")
        if not (self.training_load > 0 and math.isfinite(self.training_load)):
            out.append(f"--training-load must be positive, not {self.training_load}")
        if not self.min_runtime_s >= 0:
            out.append(f"--min-runtime must be >= 0, not {self.min_runtime_s}")
        if not self.startup_s >= 0:
            out.append(f"--startup must be >= 0, not {self.startup_s}")
        bad = [p for p in self.policies if p not in SERVING_POLICIES]
        if bad or not self.policies:
            out.append(f"--policy: unknown {', '.join(bad) or '(none)'}; policies: {', '.join(SERVING_POLICIES)}")
        return out


@dataclass
class Prepared:
    setup: ServingSetup
    jobs: list[TraceJob]
    source: str
    notes: dict[str, Any] = field(default_factory=dict)


def prepare(ev: ServingEval, data: Any = None) -> Prepared:
    """The load series, the service and the training jobs of `ev` (reads the trace data unless it is synthetic:
    `phalanx.sim.traces.DataNotFound` when it cannot be found)."""
    problems = ev.problems()
    if problems:
        raise ValueError("; ".join(problems))
    cluster = ClusterSpec(ev.nodes, ev.gpus_per_node, per_leaf=ev.nodes_per_leaf)
    service = ServingSpec(startup_s=ev.startup_s)
    envelope = DiurnalLoad(mean_rps=1.0, peak_to_trough=ev.peak_to_trough)
    peak_replicas = ev.serving_share * ev.nodes / service.replica_nodes
    mean_rps = peak_replicas * service.target_rps / (1 + envelope.amplitude)
    model = DiurnalLoad(mean_rps=mean_rps, peak_to_trough=ev.peak_to_trough, arrival_cv=ev.arrival_cv)
    load = load_series(model, ev.hours, ev.seed)
    pool = pool_for(load, service)
    if pool >= ev.nodes:
        raise ValueError(
            f"serving's busiest bin needs {pool} of the {ev.nodes} nodes: lower --serving-share or add --nodes"
        )
    setup = ServingSetup(cluster, load, service, serve_nodes=pool, min_runtime_s=ev.min_runtime_s)
    max_gpus = (ev.nodes - pool) * ev.gpus_per_node  # every gang fits the static split's training pool
    if ev.trace == "synthetic":
        shapes, source = synthetic_pool(ev.gpus_per_node, max_gpus, ev.seed), "synthetic Philly-like mix"
    else:
        from .traces import find_data, load_trace

        trace = load_trace(ev.trace, find_data(data))
        shapes, source = pool_from_trace(trace, ev.gpus_per_node, max_gpus), f"{ev.trace} ({len(trace):,} jobs)"
    mean_serving_gpus = float(load.rates.mean()) / service.target_rps * service.replica_nodes * ev.gpus_per_node
    training_gpus = ev.nodes * ev.gpus_per_node - mean_serving_gpus
    jobs = resample_training(
        shapes, gpus=training_gpus, hours=ev.hours, load=ev.training_load, seed=ev.seed, source=source
    )
    notes = {
        "load": load_summary(load),
        "serve_pool_nodes": pool,
        "replica_capacity_rps": service.capacity_rps,
        "training_source": source,
        "training_jobs": len(jobs),
        "training_gpu_hours_offered": sum(j.replicas * j.gpus_per_replica * j.duration_s for j in jobs) / 3600,
    }
    return Prepared(setup, jobs, source, notes)


def load_summary(load: LoadSeries) -> dict[str, float]:
    """What the drawn load turned out to be: mean and peak requests per second, the peak-to-trough ratio of its
    hourly means, and the index of dispersion of its bins around the envelope (about CV^2)."""
    per_hour = int(round(3600 / load.bin_s))
    hourly = load.counts[: len(load.counts) // per_hour * per_hour].reshape(-1, per_hour).mean(axis=1)
    expected = np.diff(load.model.cumulative(np.arange(len(load.counts) + 1) * load.bin_s))
    dispersion = float(np.mean((load.counts - expected) ** 2 / expected))
    return {
        "mean_rps": float(load.rates.mean()),
        "peak_bin_rps": float(load.rates.max()),
        "hourly_peak_to_trough": float(hourly.max() / hourly.min()) if len(hourly) and hourly.min() > 0 else math.nan,
        "index_of_dispersion": dispersion,
        "peak_to_trough_parameter": load.model.peak_to_trough,
        "arrival_cv_parameter": load.model.arrival_cv,
    }


def run_eval(
    ev: ServingEval, data: Any = None, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], list[ServingResult], Prepared]:
    """Every policy of `ev` on the same load and training jobs: (document, results, what was prepared)."""
    prepared = prepare(ev, data)
    if progress is not None:
        n = prepared.notes
        progress(
            f"{len(prepared.jobs)} training jobs from {prepared.source}; serving pool {n['serve_pool_nodes']} of "
            f"{ev.nodes} nodes; load mean {n['load']['mean_rps']:.1f} req/s over {ev.hours:g} h"
        )
    results = []
    for policy in ev.policies:
        started = time.perf_counter()
        result = simulate_serving(prepared.jobs, prepared.setup, policy, ev.seed)
        result.metrics["wall_s"] = time.perf_counter() - started
        results.append(result)
        if progress is not None:
            m = result.metrics
            progress(
                f"{policy}: SLO {m['serving']['slo_time_share']:.2%}, training goodput "
                f"{m['training']['goodput']:.2%}, {m['training']['preempt_lost_gpu_hours']:.1f} GPU-h lost to "
                f"preemption, utilisation {m['utilization']:.1%} ({m['wall_s']:.1f} s)"
            )
    doc = {
        "settings": asdict(ev) | {"policies": list(ev.policies)},
        **prepared.notes,
        "policies": {r.policy: r.metrics for r in results},
    }
    return doc, results, prepared


# (label, how to get the value from a policy's metrics, format)
ROWS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("serving: replica-hours (placed)", lambda m: m["serving"]["replica_hours"], "{:.0f}"),
    ("serving: time with enough ready capacity (SLO proxy)", lambda m: m["serving"]["slo_time_share"], "{:.2%}"),
    ("serving: requests beyond the ready capacity", lambda m: m["serving"]["unserved_request_share"], "{:.3%}"),
    ("serving: ready replicas at the daily peaks", lambda m: "/".join(map(str, m["serving"]["ready_at_peaks"])), "{}"),
    (
        "serving: scale-up placement delay, mean / max (s)",
        lambda m: (m["serving"]["placement_delay_mean_s"], m["serving"]["placement_delay_max_s"]),
        "{0:.0f} / {1:.0f}",
    ),
    ("training: goodput (productive / allocated)", lambda m: m["training"]["goodput"], "{:.2%}"),
    ("training: productive GPU-hours", lambda m: m["training"]["gpu_hours_productive"], "{:,.0f}"),
    (
        "training: GPU-hours lost to preemption by serving",
        lambda m: m["training"]["preempt_lost_gpu_hours"],
        "{:,.1f}",
    ),
    ("training: gangs preempted by serving", lambda m: m["training"]["preemptions"], "{}"),
    (
        "training: jobs completed / arrived",
        lambda m: (m["training"]["completed"], m["training"]["jobs"]),
        "{0:,} / {1:,}",
    ),
    ("training: mean JCT of completed jobs (h)", lambda m: m["training"]["jct_mean_h"], "{:.2f}"),
    ("training: mean queueing delay of started jobs (h)", lambda m: m["training"]["queue_delay_mean_h"], "{:.2f}"),
    ("training: GPU utilisation", lambda m: m["training"]["utilization"], "{:.1%}"),
    ("cluster: GPU utilisation (serving + training)", lambda m: m["utilization"], "{:.1%}"),
]


def markdown(doc: dict[str, Any]) -> str:
    """The table of the document's policies (one column each), with a line on the setup above it."""
    policies = list(doc["policies"])
    s, load = doc["settings"], doc["load"]
    lines = [
        f"{s['nodes']} nodes x {s['gpus_per_node']} GPUs, {s['hours']:g} h; load mean {load['mean_rps']:.1f} req/s, "
        f"hourly peak/trough {load['hourly_peak_to_trough']:.2f} (parameter {s['peak_to_trough']:g}), index of "
        f"dispersion {load['index_of_dispersion']:.2f} (CV {s['arrival_cv']:g}); serving pool {doc['serve_pool_nodes']} "
        f"nodes; {doc['training_jobs']:,} training jobs from {doc['training_source']}.",
        "",
        "| metric | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
    ]
    for label, get, fmt in ROWS:
        cells = []
        for p in policies:
            value = get(doc["policies"][p])
            cells.append(fmt.format(*value) if isinstance(value, tuple) else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict[str, Any], results: Sequence[ServingResult], out: Path) -> list[Path]:
    """`serving.md`, `serving.json` and (with matplotlib) `serving.png` in `out`; the files written."""
    import json

    from .report import _pyplot, plots_unavailable

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "serving.json"]
    (out / "serving.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    table = markdown(doc)
    plt = _pyplot()
    if plt is None:
        table += f"\nNo plot: {plots_unavailable()}.\n"
    else:
        plot(plt, results, doc, out / PLOT)
        table += f"\n![serving next to training]({PLOT})\n"
        written.append(out / PLOT)
    (out / "serving.md").write_text("# Serving next to training\n\n" + table)
    written.insert(0, out / "serving.md")
    return written


def plot(plt: Any, results: Sequence[ServingResult], doc: dict[str, Any], path: Path) -> None:
    """Three panels over time: the offered load against each policy's ready capacity, the GPUs serving holds, and
    the GPUs training holds."""
    capacity = doc["replica_capacity_rps"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    first = results[0].series
    hours = [row[0] / 3600 for row in first]
    axes[0].plot(hours, [row[1] for row in first], color="black", linewidth=0.6, label="offered load")
    for r, style in zip(results, ("-", "--", ":", "-.")):
        h = [row[0] / 3600 for row in r.series]
        ready = [row[3] * capacity for row in r.series]
        axes[0].step(h, ready, where="post", linestyle=style, label=f"{r.policy}: ready capacity")
        axes[1].step(h, [row[4] for row in r.series], where="post", linestyle=style, label=r.policy)
        axes[2].plot(h, [row[5] for row in r.series], linewidth=0.8, label=r.policy)
    axes[0].set_ylabel("requests / s"), axes[0].legend(fontsize=8), axes[0].set_title("Serving: load and capacity")
    axes[1].set_ylabel("replicas placed"), axes[1].legend(fontsize=8)
    axes[2].set_ylabel("GPUs held by training"), axes[2].set_xlabel("hours"), axes[2].legend(fontsize=8)
    axes[2].set_ylim(0, doc["settings"]["nodes"] * doc["settings"]["gpus_per_node"])
    fig.tight_layout(), fig.savefig(path, dpi=100), plt.close(fig)
