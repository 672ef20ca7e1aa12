"""The README's main command: `phalanx demo` (what ./scripts/demo runs) end to end, as a process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_demo_runs_every_job_and_the_preempted_trainer_resumes_exactly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "demo", "--port", "0", "--state-dir", str(tmp_path / "demo"),
         "--sleep", "1"],
        capture_output=True, text=True, timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "All 7 jobs SUCCEEDED." in out
    assert "is PENDING and holds 0 GPUs" in out  # the whole-cluster gang waited holding nothing
    assert "train-batch PREEMPTING" in out and "minimum runtime" in out
    assert "both ranks counted [60, 60] of 60 steps" in out
    assert "goodput of train-batch" in out
