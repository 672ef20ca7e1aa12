"""An elastic gang end to end on `LocalCluster` (real scheduler, checkpoint coordinator and simulated agents as
processes, SQLite): `phalanx.examples.count_steps` submitted with `--replicas 1:3` (one rank process per node)
starts with the 2 nodes that are free, shrinks to 1 when one of its nodes dies (no failure counted), grows back to
2 through the checkpoint handshake when another job leaves, and ends with exactly the expected count, each attempt
restored from the last committed step at its own world size."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
from helpers.local_clusters import environ_of, eventually_sync

from phalanx.client import Client, JobState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc"),
]

ENV = {"PHALANX_CHECKPOINT_POLL_S": "0.2"}


def _rows(cluster, sql: str, *params) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{cluster.state_dir / 'phalanx.db'}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _latest_step(cluster, job_id: str, attempt: int) -> int:
    rows = _rows(
        cluster,
        "SELECT step FROM checkpoints WHERE job_id = ? AND attempt = ? AND state = 'COMMITTED'",
        job_id,
        attempt,
    )
    return max((r["step"] for r in rows), default=-1)


def _nodes(cluster, job_id: str, attempt: int) -> set[str]:
    rows = _rows(
        cluster,
        "SELECT DISTINCT n.name FROM allocations a JOIN nodes n ON n.id = a.node_id WHERE a.job_id = ? AND a.attempt = ?",
        job_id,
        attempt,
    )
    return {r["name"] for r in rows}


def _rank_processes(job_id: str, node: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            env = environ_of(int(entry.name))
            if env.get("PHALANX_JOB_ID") == job_id and env.get("PHALANX_NODE") == node:
                found.append(int(entry.name))
    return found


def test_an_elastic_gang_shrinks_on_a_node_loss_and_grows_when_capacity_frees(cluster_factory, tmp_path):
    steps, out = 150, tmp_path / "out"
    cluster = cluster_factory(3, elastic_grow_interval=1.0)
    command = [sys.executable, "-m", "phalanx.examples.count_steps", "--steps", str(steps), "--every", "10"]
    command += ["--step-time", "0.1", "--out", str(out), "--sync-timeout", "120"]
    with Client(cluster.address, timeout=10) as client:
        blocker = client.submit("blocker", 1, 8, ["sleep", "600"])
        client.wait(blocker.id, ["RUNNING"], timeout=30)
        job = client.submit("elastic", 3, 8, command, procs_per_replica=1, env=ENV, min_replicas=1)
        first = client.wait(job.id, ["RUNNING"], timeout=30)
        assert (first.min_replicas, first.current_replicas) == (1, 2), first
        eventually_sync(lambda: _latest_step(cluster, job.id, 1) >= 10, timeout=60, what="a checkpoint", interval=0.05)

        # One of its nodes dies: it restarts at once on the one it still has, from its last committed step.
        victim = sorted(_nodes(cluster, job.id, 1))[0]
        cluster.kill_agent(victim)
        for pid in _rank_processes(job.id, victim):
            os.kill(pid, signal.SIGKILL)
        shrunk = eventually_sync(
            lambda: (j := client.get_job(job.id)).attempt == 2 and j.state is JobState.RUNNING and j,
            timeout=60,
            what="the shrunk attempt",
        )
        assert shrunk.current_replicas == 1 and shrunk.failures == 0, shrunk
        eventually_sync(
            lambda: _latest_step(cluster, job.id, 2) >= 0, timeout=60, what="a checkpoint at 1", interval=0.05
        )

        # The blocker leaves: the gang grows back to 2 (the dead node stays out) through the checkpoint handshake.
        client.cancel(blocker.id)
        grown = eventually_sync(
            lambda: (j := client.get_job(job.id)).attempt == 3 and j.state is JobState.RUNNING and j,
            timeout=60,
            what="the grown attempt",
        )
        assert grown.current_replicas == 2 and victim not in grown.nodes, grown
        done = client.wait(job.id, timeout=120)
    assert done.state is JobState.SUCCEEDED, done
    assert (done.attempt, done.failures, done.preemptions) == (3, 0, 0), done
    attempts = _rows(cluster, "SELECT * FROM job_attempts WHERE job_id = ? ORDER BY attempt", job.id)
    assert [a["outcome"] for a in attempts] == ["NODE_LOST", "RESIZED", "SUCCEEDED"], [dict(a) for a in attempts]
    assert attempts[1]["restored_step"] == attempts[0]["committed_step"] >= 10
    assert attempts[2]["restored_step"] == attempts[1]["committed_step"] >= attempts[0]["committed_step"]
    for rank in range(2):  # the last attempt's two ranks each counted exactly `steps`
        result = json.loads((out / job.id / f"rank-{rank}.json").read_text())
        assert (result["count"], result["step"], result["attempt"]) == (steps, steps, 3), result
