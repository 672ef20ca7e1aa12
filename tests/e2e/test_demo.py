"""The README's main command: `phalanx demo` (what ./scripts/demo runs) end to end, as a process."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_demo_runs_every_job_and_the_preempted_trainer_resumes_exactly(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli.main",
            "demo",
            "--port",
            "0",
            "--state-dir",
            str(tmp_path / "demo"),
            "--sleep",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    if importlib.util.find_spec("torch") is None:
        assert "All 7 jobs SUCCEEDED." in out and "skips its DistributedDataParallel job" in out
    else:  # the eighth job: a real torch.distributed gang
        assert "All 8 jobs SUCCEEDED." in out
        assert re.search(
            r"ddp-tiny: 4 ranks on node-\d+(, node-\d+)? checked an all-reduce, trained 60 steps and "
            r"saved 3 collective checkpoints .* every rank ends with the same parameters",
            out,
        ), out[-3000:]
    assert "is PENDING and holds 0 GPUs" in out  # the whole-cluster gang waited holding nothing
    assert "train-batch PREEMPTING" in out and "minimum runtime" in out
    assert "both ranks counted [60, 60] of 60 steps" in out
    # Preempted once, and its preemptor ran before its next attempt (issue 30: the claim).
    assert re.search(
        r"train-batch was preempted 1 time\(s\); urgent-\d+x8 started at [\d:]+, before train-batch's attempt 2", out
    ), out[-3000:]
    assert "goodput of train-batch" in out
    # The serving step: both replicas ready behind their probe, a rolling update that kept both ready, the deletion.
    assert "ready: 2/2; endpoints #0 127.0.0.1:8000, #1 127.0.0.1:8000" in out, out[-3000:]
    assert "revision 2 on both replicas; at least 2 of 2 were ready at every look" in out, out[-3000:]
    assert "service chat deleted" in out
    # Rank 0 of the 2 x 8 gang, through `phalanx logs` (its node's agent), not whichever log sorts first.
    assert re.search(r"logs \w+ --rank 0 --tail 3\n  rank 0/16 on node-\d+ CUDA_VISIBLE_DEVICES=GPU-", out), out[-3000:]
