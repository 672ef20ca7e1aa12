"""Job graphs end to end on `LocalCluster` (real scheduler and simulated agents as processes, SQLite; issue 34): an
array of 20 tasks with `%3` runs every index once, never more than 3 at once, each rank with its
PHALANX_ARRAY_TASK_ID; a job `--after` the array starts only once its last task has ended. Each rank writes when it
ran, from its own clock, into the test's directory."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.local_clusters import eventually_sync

from phalanx.client import Client, JobState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# A rank: note its index and environment, run a moment, note its end (the files are the test's evidence).
RANK = """
import json, os, sys, time
out = sys.argv[1]
tag = os.environ.get("PHALANX_ARRAY_TASK_ID", "after")
start = time.time()
time.sleep(float(sys.argv[2]))
with open(os.path.join(out, tag + ".json"), "w") as f:
    json.dump({"start": start, "end": time.time(), "array": os.environ.get("PHALANX_ARRAY_JOB_ID", ""),
               "slurm": os.environ.get("SLURM_ARRAY_TASK_ID", "")}, f)
"""


def test_an_array_of_20_with_limit_3_and_a_dependent_job_run_in_order(cluster_factory, tmp_path):
    cluster = cluster_factory(4)
    out = tmp_path / "ranks"
    out.mkdir()
    command = [sys.executable, "-c", RANK, str(out)]
    with Client(cluster.address) as client:
        array = client.submit("sweep", 1, 8, [*command, "0.3"], procs_per_replica=1, array="0-19%3")
        assert array.array is not None and array.array.tasks == 20 and array.array.limit == 3
        after = client.submit("report", 1, 8, [*command, "0"], procs_per_replica=1, after=[array.id])
        assert after.state == JobState.PENDING and after.message == f"waits for job {array.id} to succeed"

        def ended(job_id: str):
            job = client.get_job(job_id)
            return job if job.terminal else None

        done = eventually_sync(lambda: ended(array.id), timeout=180, what="the array ended")
        assert done.state == JobState.SUCCEEDED, done.message
        assert done.array is not None and (done.array.succeeded, done.array.failed) == (20, 0)
        report = eventually_sync(lambda: ended(after.id), timeout=60, what="the dependent job ended")
        assert report.state == JobState.SUCCEEDED, report.message

    tasks = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json") if p.stem != "after"}
    assert sorted(tasks) == list(range(20))  # every index ran, once (one rank per task)
    assert {t["array"] for t in tasks.values()} == {array.id}
    assert all(t["slurm"] == str(i) for i, t in tasks.items())
    # Never more than 3 at once: at each task's start, fewer than 3 others had started and not yet ended
    for i, t in tasks.items():
        overlapping = [j for j, o in tasks.items() if j != i and o["start"] <= t["start"] < o["end"]]
        assert len(overlapping) < 3, (i, overlapping)
    last_end = max(t["end"] for t in tasks.values())
    assert json.loads((out / "after.json").read_text())["start"] >= last_end
