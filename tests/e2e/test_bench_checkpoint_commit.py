"""bench/checkpoint_commit.py runs end to end (a smoke run on SQLite) and ends with one JSON line of figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_commit_latency_and_its_baseline_as_one_json_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "checkpoint_commit.py"),
            "--quick",
            "--ranks",
            "8",
            "--checkpoints",
            "2",
            "--no-pg",
            "--no-ddp",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["bench"] == "checkpoint_commit"
    assert out["ranks"] == [8]
    assert out["postgresql"] == {"skipped": "--no-pg"}
    assert out["ddp"] == {"skipped": "--no-ddp"}
    sqlite = out["sqlite"]
    assert sqlite["durability"]["journal_mode"] == "wal"
    assert sqlite["durability"]["synchronous"] in ("NORMAL", "FULL", "EXTRA")
    eight = sqlite["8"]
    assert eight["checkpoints"] == 2
    for key in (
        "commit_p50_ms",
        "commit_p99_ms",
        "commit_mean_ms",
        "checkpoint_p50_ms",
        "checkpoint_p99_ms",
        "shards_per_s",
        "commit_p50_over_baseline",
    ):
        assert eight[key] > 0, key
    assert eight["commit_p50_ms"] <= eight["commit_p99_ms"]
    assert eight["commit_p50_ms"] <= eight["checkpoint_p50_ms"]  # the last shard is part of the whole checkpoint
    base = sqlite["baseline"]
    for key in ("durable_commit_p50_ms", "durable_commit_p99_ms", "health_rpc_p50_ms", "health_rpc_p99_ms"):
        assert base[key] > 0, key
    assert base["samples"] > 0
    assert not list(tmp_path.iterdir()), "the bench removes its SQLite file and log"
