"""bench/live_scale.py runs end to end at a tiny size (real scheduler processes on PostgreSQL, lightweight agents)
and ends with one JSON line of figures; its target check names what a run missed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.bench import bench_server, run_bench

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import live_scale

pytestmark = pytest.mark.postgres


def test_tiny_run_prints_every_figure_as_one_json_line(pg_url):
    out, _ = run_bench(
        "live_scale.py",
        "--nodes",
        "32",
        "--pending",
        "60",
        "--history",
        "300",
        "--steady",
        "2",
        "--runtime",
        "0.2,1",
        "--no-targets",
        "--db",
        bench_server(pg_url),
        timeout=240,
    )
    assert out["nodes"] == 32 and out["gpus"] == 256
    for key in (
        "bringup_s",
        "cycle_p99_ms_1",
        "cycle_p99_ms_2",
        "cycle_measured_p99_ms_1",
        "cycle_measured_p99_ms_2",
        "reservations_per_s_1",
        "reservations_per_s_2",
        "submit_p99_ms",
        "jobs_page_p50_ms",
        "job_p50_ms",
        "goodput_p50_ms",
        "rss_empty_mib",
        "rss_history_mib",
        "rss_live_mib",
        "empty_cluster_per_s",
        "drain_per_s",
        "drain_over_empty",
        "drain_refill_first_ms",
        "drain_span_s",
        "goodput_direct_p50_ms",
        "rank_report_p99_ms_1",
        "status_lane_batch_p99_le_ms",
        "accept_lane_batch_p99_le_ms",
        "server_SubmitJob_p99_le_ms",
    ):
        assert isinstance(out[key], (int, float)), key
    assert out["reservations_1"] > 0
    assert out["drain_cancelled"] >= 0  # (at this size the gangs may all have ended by then)
    assert out["targets_missed"] == []  # --no-targets: printed, not checked


def test_the_target_check_names_each_missed_target():
    good = dict(
        bringup_s=30.0,
        cycle_measured_p99_ms_1=150.0,
        cycle_measured_p99_ms_2=150.0,
        replicas_ratio=1.0,
        jobs_page_p50_ms=20.0,
        job_p50_ms=10.0,
        rss_history_mib=110.0,
        rss_empty_mib=100.0,
        drain_per_s=400.0,
        empty_cluster_per_s=500.0,
        drain_over_empty=0.8,
    )
    assert live_scale.check_targets(good) == []
    bad = dict(good, bringup_s=75.0, cycle_measured_p99_ms_2=300.0, replicas_ratio=0.5, rss_history_mib=300.0)
    bad.update(drain_per_s=100.0, drain_over_empty=0.2)
    missed = live_scale.check_targets(bad)
    assert len(missed) == 5
    assert any("deep-queue drain 100.0 gangs/s, 0.2x" in m for m in missed)
    assert any("bring-up 75.0 s" in m for m in missed)
    assert any("2 replica" in m for m in missed)


def test_histogram_quantiles_are_bucket_upper_bounds():
    text = "\n".join(
        [
            'c_bucket{le="0.01"} 50.0',
            'c_bucket{le="0.1"} 98.0',
            'c_bucket{le="1.0"} 100.0',
            'c_bucket{le="+Inf"} 100.0',
            "c_count 100.0",
            "c_sum 3.5",
        ]
    )
    h = live_scale.Histogram(text, "c")
    assert h.quantile(0.5) == 0.01
    assert h.quantile(0.99) == 1.0
    assert h.minus(live_scale.Histogram("", "c")).count == 100.0
    labelled = "\n".join(
        [
            'r_bucket{le="0.01",method="A"} 5.0',
            'r_bucket{le="0.01",method="B"} 1.0',
            'r_bucket{method="B",le="0.1"} 4.0',
            'r_count{method="B"} 4.0',
            'r_count{method="A"} 5.0',
        ]
    )
    b = live_scale.Histogram(labelled, "r", 'method="B"')
    assert b.count == 4.0 and b.quantile(0.5) == 0.1 and b.quantile(0.2) == 0.01


def test_the_cycle_log_measures_each_cycle_written_since_its_mark(tmp_path):
    path = tmp_path / "scheduler.log"
    path.write_text('{"event": "cycle_slow", "ms": 900.0, "lock_ms": 0.1}\n')
    log = live_scale.CycleLog(path)
    log.mark()  # what came before the phase is not its
    with open(path, "a") as f:
        f.write('{"commands": 3, "cycle": 7, "event": "cycle_slow", "lock_ms": 0.2, "ms": 12.5}\n')
        f.write('{"event": "node_lost", "ms": 99.0, "reason": "no cycle_slow here"}\n')
        f.write("2026-12-07 [info     ] cycle_slow  commands=1 deferred_ms=3.0 lock_ms=0.1 ms=180.25\n")
    assert log.since_mark() == [0.0125, 0.18025]
