"""bench/goodput_read.py runs end to end at a tiny size on PostgreSQL and ends with one JSON line; the read and its
baseline count the same jobs, every one the bench wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.postgres


def test_tiny_run_counts_every_job_and_prints_one_json_line(pg_url):
    admin = pg_url.rsplit("/", 1)[0] + "/test"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "goodput_read.py"),
            "--pending",
            "200",
            "--running",
            "30",
            "--history",
            "500",
            "--samples",
            "3",
            "--no-targets",
            "--db",
            os.environ.get("PHALANX_BENCH_PG", admin),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["read_jobs_counted"] == out["baseline_jobs_counted"] == 730
    assert out["same_count"] is True
    for key in ("read_p50_ms", "read_p99_ms", "baseline_p50_ms", "read_sql_ms", "read_python_ms"):
        assert out[key] > 0, key
