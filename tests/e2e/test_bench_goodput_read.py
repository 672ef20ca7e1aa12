"""bench/goodput_read.py runs end to end at a tiny size on PostgreSQL and ends with one JSON line; the read and its
baseline count the same jobs, every one the bench wrote."""

from __future__ import annotations

import pytest
from helpers.bench import bench_server, run_bench

pytestmark = pytest.mark.postgres


def test_tiny_run_counts_every_job_and_prints_one_json_line(pg_url):
    out, _ = run_bench(
        "goodput_read.py",
        *("--pending", "200", "--running", "30", "--history", "500", "--samples", "3"),
        *("--no-targets", "--db", bench_server(pg_url)),
    )
    assert out["read_jobs_counted"] == out["baseline_jobs_counted"] == 730
    assert out["same_count"] is True
    for key in ("read_p50_ms", "read_p99_ms", "baseline_p50_ms", "read_sql_ms", "read_python_ms"):
        assert out[key] > 0, key
