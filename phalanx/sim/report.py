"""The simulation report: `result.json` (every metric, per policy), `report.md` (tables) and PNG plots
(utilisation over time, the JCT CDF, and bars per policy). The plots need matplotlib, the `plots` extra
(`pip install 'phalanx[plots]'`); without it the report has everything but the plots, and says so."""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path

from .engine import SimResult

PLOTS_EXTRA = "pip install 'phalanx[plots]'"

ROWS = [
    ("completed", "jobs completed", "{:.0f}"),
    ("jobs_per_hour", "jobs completed per hour", "{:.2f}"),
    ("gpu_hours_delivered", "GPU-hours delivered", "{:.0f}"),
    ("utilization_allocated", "GPU utilisation, allocated", "{:.1%}"),
    ("utilization_productive", "GPU utilisation, productive", "{:.1%}"),
    ("jct_mean_h", "JCT mean (h)", "{:.2f}"),
    ("jct_median_h", "JCT median (h)", "{:.2f}"),
    ("jct_p99_h", "JCT p99 (h)", "{:.2f}"),
    ("queue_delay_mean_h", "queueing delay mean (h)", "{:.2f}"),
    ("queue_delay_p99_h", "queueing delay p99 (h)", "{:.2f}"),
    ("within_one_leaf", "multi-node gangs within one leaf", "{:.1%}"),
    ("leaf_crossings_per_multi_node_gang", "leaf crossings per multi-node gang", "{:.2f}"),
    ("cross_spine_tb", "AllReduce traffic across leaf uplinks (TB)", "{:.1f}"),
    ("idle_gpu_hours_while_jobs_wait", "idle GPU-hours while jobs wait (fragmentation)", "{:.0f}"),
    ("hoarded_gpu_hours", "GPU-hours hoarded by partly placed gangs", "{:.0f}"),
    ("preemptions", "preemptions (gangs checkpointed and requeued)", "{:.0f}"),
    ("reclaims", "of them, quota reclaims", "{:.0f}"),
    ("preempt_lost_gpu_hours", "GPU-hours lost to preemption (checkpoint grace + rollback)", "{:.1f}"),
    ("peak_running_jobs", "most jobs running at once", "{:.0f}"),
    ("fairness_jain", "fairness vs quotas (Jain's index of received / entitled GPU-hours)", "{:.3f}"),
    ("makespan_h", "makespan (h)", "{:.1f}"),
]


def write_report(results: Sequence[SimResult], out: Path, title: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    doc = {r.policy: r.metrics for r in results}
    (out / "result.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    lines = [
        f"# {title}",
        "",
        "| metric | " + " | ".join(r.policy for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for key, label, fmt in ROWS:
        cells = []
        for r in results:
            value = r.metrics.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    goodput = [r.metrics["goodput"]["ratio"] for r in results]
    lines.append("| goodput (productive / allocated) | " + " | ".join(f"{g:.1%}" for g in goodput) + " |")
    tenants = sorted({t for r in results for t in r.metrics.get("tenants", {})})
    if len(tenants) > 1:
        lines += [
            "",
            "## Per tenant",
            "",
            "GPU-h: the work its jobs asked for; received: its share of the GPU-hours held by all tenants; "
            "fair: GPU-hours received / entitled, where its entitlement at each moment is its quota's "
            "weighted max-min share of the cluster over what the tenants wanted then (1: got its due).",
            "",
            "| tenant | quota share | "
            + " | ".join(
                f"{r.policy}: GPU-h / received / fair / mean JCT (h) / mean wait (h) / preempted" for r in results
            )
            + " |",
            "|---|---|" + "---|" * len(results),
        ]
        for name in tenants:
            share = next(
                (r.metrics["tenants"][name]["quota_share"] for r in results if name in r.metrics.get("tenants", {})),
                0.0,
            )
            cells = []
            for r in results:
                t = r.metrics.get("tenants", {}).get(name)
                cells.append(
                    "-"
                    if t is None
                    else f"{t['gpu_hours']:.0f} / {t.get('received_share', float('nan')):.1%} / "
                    f"{t.get('fair_ratio', float('nan')):.2f} / {t['jct_mean_h']:.2f} / "
                    f"{t['queue_delay_mean_h']:.2f} / {t.get('preempted', 0)}"
                )
            lines.append(f"| {name} | {share:.1%} | " + " | ".join(cells) + " |")
    classes = sorted({c for r in results for c in r.metrics.get("priorities", {})}, key=int, reverse=True)
    if len(classes) > 1:
        lines += [
            "",
            "## Per priority",
            "",
            "| priority | "
            + " | ".join(f"{r.policy}: jobs / mean JCT (h) / mean wait (h) / preempted" for r in results)
            + " |",
            "|---|" + "---|" * len(results),
        ]
        for c in classes:
            cells = []
            for r in results:
                m = r.metrics.get("priorities", {}).get(c)
                cells.append(
                    "-"
                    if m is None
                    else f"{m['jobs']} / {m['jct_mean_h']:.2f} / {m['queue_delay_mean_h']:.2f} / {m['preempted']}"
                )
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    dead = [r for r in results if r.metrics.get("deadlocked")]
    for r in dead:
        lines.append("")
        lines.append(
            f"Policy `{r.policy}` deadlocked at t={r.metrics['deadlocked']:.0f}s: partly placed gangs held "
            "GPUs the others needed."
        )
    plt = _pyplot()
    if plt is None:
        lines += ["", f"No plots: {plots_unavailable()}."]
    else:
        lines += ["", *[f"![{name}]({name})" for name in _plots(plt, results, out)]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return doc


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib cannot be imported (the `plots` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the tables are the report; the plots are a bonus
        return None
    return plt


def plots_unavailable() -> str:
    """Why the report will have no plots ("" when it will): matplotlib is missing, and how to install it."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); for the plots: {PLOTS_EXTRA}"
    if _pyplot() is None:
        return f"matplotlib.pyplot cannot be imported; for the plots: {PLOTS_EXTRA}"
    return ""


def _plots(plt, results: Sequence[SimResult], out: Path) -> list[str]:
    names = []
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        if r.timeline:
            ax.plot([t / 3600 for t, _ in r.timeline], [u * 100 for _, u in r.timeline], label=r.policy)
    ax.set_xlabel("hours"), ax.set_ylabel("GPUs allocated (%)"), ax.legend(), ax.set_title("Utilisation over time")
    fig.tight_layout(), fig.savefig(out / "utilization.png", dpi=100), plt.close(fig)
    names.append("utilization.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        if r.jct:
            n = len(r.jct)
            ax.plot([j / 3600 for j in r.jct], [(i + 1) / n for i in range(n)], label=r.policy)
    ax.set_xscale("log"), ax.set_xlabel("JCT (hours, log)"), ax.set_ylabel("fraction of jobs"), ax.legend()
    ax.set_title("Job completion time CDF")
    fig.tight_layout(), fig.savefig(out / "jct_cdf.png", dpi=100), plt.close(fig)
    names.append("jct_cdf.png")
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (key, label) in zip(
        axes,
        (
            ("utilization_allocated", "utilisation"),
            ("jct_mean_h", "mean JCT (h)"),
            ("queue_delay_mean_h", "mean queueing delay (h)"),
        ),
        strict=True,
    ):
        ax.bar([r.policy for r in results], [r.metrics[key] for r in results])
        ax.set_title(label), ax.tick_params(axis="x", rotation=30)
    fig.tight_layout(), fig.savefig(out / "policies.png", dpi=100), plt.close(fig)
    names.append("policies.png")
    return names
