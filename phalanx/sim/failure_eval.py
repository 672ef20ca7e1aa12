"""The four recovery policies compared on one workload and one draw of failures (`phalanx sim failures`,
`bench/failure_policies.py`).

The workload: `large` pre-training gangs (each `large_nodes` whole nodes, `large_days` days of work, submitted at
the start, high priority) beside background jobs that keep the rest of the cluster busy, arriving as a Poisson
process at `load` of the GPUs the gangs leave. The background is resampled (seeded) from the Philly-derived trace in
`../shared/data/` when it is there (`background="philly"`, or `"auto"` finding it), else from a synthetic Philly-like
mix (`"synthetic"`; no data needed). Or `trace=SPEC` replays a trace of `phalanx sim run` as it is (e.g. `mix`).

Each policy replays the same jobs with the same failure draws (`seed`) through `simulate_failures`; the table has the
large jobs' ETTR and goodput, the GPU-hours held as spares, mean JCT and utilisation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.core.recovery import POLICIES, RestartCosts

from .cluster import ClusterSpec
from .failures import LLAMA3_PER_GPU_DAY, FailureModel
from .recovery_replay import RecoveryConfig, simulate_failures
from .serving_training import pool_from_trace, resample_training, synthetic_pool
from .trace_records import TraceJob

LARGE_PRIORITY = 100
SOURCE_NOTE = (
    "failure rate: Llama 3 (Dubey et al. 2024, 'The Llama 3 Herd of Models', section 3.3.4): 419 unexpected "
    "interruptions in 54 days on 16,384 H100 GPUs = 4.74e-4 per GPU-day"
)


@dataclass(frozen=True)
class FailureEval:
    """One comparison: the cluster, the workload, the failures and the recovery settings."""

    cluster: str = "576x8,leaf=18,spine=8"
    large: int = 4
    large_nodes: int = 112
    large_days: float = 14.0
    background: str = "auto"  # auto | philly | synthetic
    load: float = 1.0
    max_job_hours: float = 8.0
    min_job_hours: float = 0.5  # background jobs shorter than this are left out (they add passes, not load)
    trace: str = ""  # a `phalanx sim run` trace spec replayed as is instead of the generated workload
    failures_per_gpu_day: float = LLAMA3_PER_GPU_DAY
    repair_hours: float = 4.0
    costs: RestartCosts = field(default_factory=RestartCosts)
    spares_per_domain: int = 1
    large_threshold: int = 8  # a gang of at least this many whole nodes is "large" (spares, elastic, ETTR)
    elastic_min: float = 0.75
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    data: str | None = None

    def problems(self) -> list[str]:
        out = []
        try:
            ClusterSpec.parse(self.cluster)
        except ValueError as exc:
            out.append(str(exc))
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            out.append(f"--policy: unknown {', '.join(bad) or '(none)'}; policies: {', '.join(POLICIES)}")
        if self.background not in ("auto", "philly", "synthetic"):
            out.append("--background must be auto, philly or synthetic")
        checks = (
            (self.large >= 0, "--large must be >= 0"),
            (self.large_nodes >= 1, "--large-nodes must be >= 1"),
            (self.large_days > 0, "--large-days must be > 0"),
            (self.load >= 0, "--load must be >= 0"),
            (self.max_job_hours > 0, "--max-job-hours must be > 0"),
            (0 <= self.min_job_hours <= self.max_job_hours, "--min-job-hours must be 0..--max-job-hours"),
            (self.repair_hours > 0, "--repair-hours must be > 0"),
            (self.spares_per_domain >= 0, "--spares must be >= 0"),
            (self.large_threshold >= 1, "--large-threshold must be >= 1"),
            (0 < self.elastic_min <= 1, "--elastic-min must be in (0, 1]"),
        )
        out += [why for ok, why in checks if not ok]
        return out


def build_workload(ev: FailureEval) -> tuple[list[TraceJob], str]:
    """The jobs of `ev` and a line saying where they come from (reads the data only for philly/auto or a trace)."""
    from .traces import DataNotFound, find_data, load_trace

    cluster = ClusterSpec.parse(ev.cluster)
    if ev.trace:
        jobs = [
            j
            for j in load_trace(ev.trace, find_data(ev.data))
            if 0 < j.gpus_per_replica <= cluster.gpus
            and j.replicas * j.gpus_per_replica <= cluster.nodes * cluster.gpus
        ]
        return jobs, f"trace {ev.trace} ({len(jobs)} jobs that fit)"
    big = [
        TraceJob(
            job_id=f"pretrain{i}",
            tenant="pretrain",
            submit_s=0.0,
            replicas=ev.large_nodes,
            gpus_per_replica=cluster.gpus,
            gpu_milli=0,
            duration_s=ev.large_days * 86400.0,
            model="pretrain",
            source="synthetic:pretrain",
            priority=LARGE_PRIORITY,
        )
        for i in range(ev.large)
    ]
    left = max(0, cluster.nodes - ev.large * ev.large_nodes) * cluster.gpus
    max_gpus = min(left, 8 * cluster.gpus) if left else cluster.gpus
    source = "synthetic Philly-like mix"
    pool = []
    if ev.background in ("auto", "philly"):
        try:
            pool = pool_from_trace(load_trace("philly", find_data(ev.data)), cluster.gpus, max_gpus)
            source = f"resampled from the Philly-derived trace ({len(pool)} job shapes)"
        except DataNotFound:
            if ev.background == "philly":
                raise
    if not pool:
        pool = synthetic_pool(cluster.gpus, max_gpus, ev.seed)
    pool = [shape for shape in pool if shape[2] >= ev.min_job_hours * 3600.0] or pool
    background: list[TraceJob] = []
    if ev.load > 0 and left > 0:
        background = resample_training(
            pool,
            gpus=float(left),
            hours=ev.large_days * 24,
            load=ev.load,
            seed=ev.seed,
            max_job_hours=ev.max_job_hours,
            backlog_hours=0.0,
            source=source,
        )
    jobs = sorted(big + background, key=lambda j: (j.submit_s, j.job_id))
    return jobs, f"{len(big)} gangs of {ev.large_nodes} nodes + {len(background)} background jobs {source}"


def run_eval(ev: FailureEval, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every policy of `ev` on the same jobs and failures: {"rows": [...], "results": {policy: metrics}, ...}."""
    cluster = ClusterSpec.parse(ev.cluster)
    jobs, source = build_workload(ev)
    model = FailureModel(ev.failures_per_gpu_day, cluster.gpus, ev.repair_hours * 3600.0)
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for policy in ev.policies:
        config = RecoveryConfig(policy, model, ev.costs, ev.spares_per_domain, ev.large_threshold, ev.elastic_min)
        t0 = time.perf_counter()
        m = simulate_failures(jobs, cluster, config, seed=ev.seed).metrics
        results[policy] = m
        if progress is not None:
            progress(
                f"{policy}: ETTR {m['ettr']:.4f}, {m['node_failures']} failures ({m['large_gang_hits']} on large "
                f"gangs), {time.perf_counter() - t0:.1f} s"
            )
    rows = [table_row(p, results[p]) for p in ev.policies]
    return {
        "source": source,
        "jobs": len(jobs),
        "cluster": ev.cluster,
        "failures_per_gpu_day": ev.failures_per_gpu_day,
        "repair_hours": ev.repair_hours,
        "costs": dataclasses.asdict(ev.costs),
        "spares_per_domain": ev.spares_per_domain,
        "elastic_min": ev.elastic_min,
        "seed": ev.seed,
        "settings": {k: v for k, v in dataclasses.asdict(ev).items() if k not in ("costs", "data")},
        "citation": SOURCE_NOTE,
        "rows": rows,
        "results": results,
        "wall_s": time.perf_counter() - started,
    }


def table_row(policy: str, m: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy": policy,
        "ettr": m["ettr"],
        "goodput": m["large_goodput"]["ratio"],
        "spare_gpu_hours": m["spare_gpu_hours"],
        "jct_mean_h": m["jct_mean_h"],
        "large_jct_mean_h": m["large_jct_mean_h"],
        "utilization": m["utilization_allocated"],
        "failures": m["node_failures"],
        "large_hits": m["large_gang_hits"],
        "swaps": m["swaps"],
        "shrinks": m["shrinks"],
        "requeues": m["requeues"],
        "lost_work_gang_h": m["lost_work_gang_hours"],
    }


def markdown(doc: dict[str, Any]) -> str:
    """The four-policy table (Markdown)."""
    lines = [
        "| policy | ETTR (large jobs) | goodput (large jobs) | spare GPU-hours | mean JCT (h), all / large | "
        "utilisation | failures (on large gangs) | swaps / shrinks / requeues |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['policy']} | {_pct(r['ettr'])} | {_pct(r['goodput'])} | {r['spare_gpu_hours']:,.0f} | "
            f"{r['jct_mean_h']:.2f} / {r['large_jct_mean_h']:.1f} | {_pct(r['utilization'])} | "
            f"{r['failures']} ({r['large_hits']}) | {r['swaps']} / {r['shrinks']} / {r['requeues']} |"
        )
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.2f}%"


def write_outputs(doc: dict[str, Any], out: Path) -> list[str]:
    """`out/failures.json`, `out/failures.md` and, with matplotlib, `out/failure_policies.png`; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "failures.json").write_text(json.dumps(doc, indent=1, default=float))
    written = ["failures.json"]
    plot = plot_policies(doc, out / "failure_policies.png")
    text = [
        f"# Recovery policies under failures: {doc['cluster']}",
        "",
        f"Workload: {doc['source']}; {doc['jobs']} jobs. Failures {doc['failures_per_gpu_day']:.3g} per GPU-day "
        f"({doc['citation']}), repair mean {doc['repair_hours']} h, seed {doc['seed']}.",
        "",
        markdown(doc),
        "",
        *([f"![policies]({Path(plot).name})"] if plot else []),
    ]
    (out / "failures.md").write_text("\n".join(text) + "\n")
    written.append("failures.md")
    if plot:
        written.append(Path(plot).name)
    return written


def plot_policies(doc: dict[str, Any], path: Path) -> str:
    """Bars per policy: ETTR, goodput and spare GPU-hours (matplotlib); "" without matplotlib."""
    from .report import _pyplot

    plt = _pyplot()
    if plt is None:
        return ""
    rows: Sequence[dict[str, Any]] = doc["rows"]
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = (("ettr", "ETTR of the large jobs (%)", 100), ("goodput", "goodput of the large jobs (%)", 100))
    for ax, (key, title, scale) in zip(axes[:2], panels, strict=True):
        values = [scale * r[key] for r in rows]
        ax.bar(names, values)
        low = min(values) if values else 0
        ax.set_ylim(max(0.0, low - 2 * (100 - low) - 0.5), 100)
        ax.set_title(title), ax.tick_params(axis="x", rotation=30)
    axes[2].bar(names, [r["spare_gpu_hours"] for r in rows])
    axes[2].set_title("GPU-hours held as spares"), axes[2].tick_params(axis="x", rotation=30)
    fig.suptitle(f"{doc['cluster']}, {doc['failures_per_gpu_day']:.3g} failures per GPU-day")
    fig.tight_layout(), fig.savefig(path, dpi=100), plt.close(fig)
    return str(path)
