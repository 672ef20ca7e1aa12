"""Recovery end to end on `LocalCluster` (real scheduler, checkpoint coordinator and simulated agents as processes,
SQLite): the sample program `phalanx.examples.count_steps` runs as a 2-node gang (one rank process per node),
counts steps and checkpoints every K steps through phalanx.train.

- A node dies (its agent and its rank are SIGKILLed): the node goes LOST, the gang is torn down whole and restarts
  on the two other nodes from the last committed step, and ends with exactly the expected count.
- A priority-100 gang preempts it: the victim is asked to checkpoint (PREEMPTING), stops once that checkpoint
  commits, the preemptor runs, and the victim resumes from that step, ending with exactly the expected count.

The ledger (SQLite) is read directly for what the SDK does not show: checkpoints, job_attempts, counters.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from helpers.local_clusters import environ_of, eventually_sync

from phalanx.cli.cluster import LocalCluster
from phalanx.client import Client, JobState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc"),
]

EVERY = 10
STEP_TIME = 0.1
ENV = {"PHALANX_CHECKPOINT_POLL_S": "0.2"}  # rank 0 sees a checkpoint request within 0.2 s


def _command(steps: int, out: Path, every: int = EVERY) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx.examples.count_steps",
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--step-time",
        str(STEP_TIME),
        "--out",
        str(out),
        "--sync-timeout",
        "120",
    ]


class Ledger:
    """Read-only queries on the cluster's SQLite ledger."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.path = cluster.state_dir / "phalanx.db"

    def rows(self, sql: str, *params) -> list[sqlite3.Row]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def job(self, job_id: str) -> sqlite3.Row:
        return self.rows("SELECT * FROM jobs WHERE id = ?", job_id)[0]

    def attempts(self, job_id: str) -> list[sqlite3.Row]:
        return self.rows("SELECT * FROM job_attempts WHERE job_id = ? ORDER BY attempt", job_id)

    def committed(self, job_id: str, attempt: int | None = None) -> list[sqlite3.Row]:
        sql = "SELECT * FROM checkpoints WHERE job_id = ? AND state = 'COMMITTED'"
        params: tuple = (job_id,)
        if attempt is not None:
            sql, params = sql + " AND attempt = ?", (job_id, attempt)
        return self.rows(sql + " ORDER BY step", *params)

    def latest_step(self, job_id: str) -> int:
        steps = [r["step"] for r in self.committed(job_id)]
        return max(steps, default=-1)

    def node_state(self, name: str) -> str:
        return self.rows("SELECT state FROM nodes WHERE name = ?", name)[0]["state"]

    def attempt_nodes(self, job_id: str, attempt: int) -> dict[int, str]:
        rows = self.rows(
            "SELECT DISTINCT a.replica, n.name FROM allocations a JOIN nodes n ON n.id = a.node_id "
            "WHERE a.job_id = ? AND a.attempt = ?",
            job_id,
            attempt,
        )
        return {r["replica"]: r["name"] for r in rows}


def _events(out: Path, job_id: str) -> list[dict]:
    path = out / job_id / "events.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _results(out: Path, job_id: str, world: int) -> list[dict]:
    return [json.loads((out / job_id / f"rank-{r}.json").read_text()) for r in range(world)]


def _rank_processes(job_id: str, node: str) -> list[int]:
    """Live processes (rank wrappers and rank commands) of `job_id` on simulated node `node`, by their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        env = environ_of(int(entry.name))
        if env.get("PHALANX_JOB_ID") == job_id and env.get("PHALANX_NODE") == node:
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if not stat[stat.rfind(")") + 2 :].startswith("Z"):
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return not stat[stat.rfind(")") + 2 :].startswith(("Z", "X"))


def test_node_kill_resumes_on_other_nodes_from_the_last_committed_step(cluster_factory, tmp_path):
    steps = 80
    out = tmp_path / "out"
    cluster = cluster_factory(3)
    ledger = Ledger(cluster)
    with Client(cluster.address, timeout=10) as client:
        job = client.submit("count-steps", 2, 8, _command(steps, out), procs_per_replica=1, env=ENV)
        job = client.wait(job.id, ["RUNNING"], timeout=30)
        first_nodes = ledger.attempt_nodes(job.id, 1)
        assert len(set(first_nodes.values())) == 2, first_nodes
        eventually_sync(
            lambda: ledger.latest_step(job.id) >= 20, timeout=90, what="a checkpoint >= step 20", interval=0.05
        )

        # -- the node of rank 0 dies: its agent, then every rank process on it (wrapper and command) ---------------
        victim = first_nodes[0]
        cluster.kill_agent(victim)
        ranks_file = json.loads((cluster.agent_state_dir(victim) / "state.json").read_text())["ranks"]
        recorded = {
            pid
            for r in ranks_file.values()
            if r["job_id"] == job.id
            for pid in (r["wrapper_pid"], r["child_pid"])
            if pid
        }
        killed = _rank_processes(job.id, victim)
        assert recorded and recorded <= set(killed), (recorded, killed)  # the agent's state names the same pids
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        committed_at_kill = ledger.latest_step(job.id)
        eventually_sync(lambda: not any(_alive(p) for p in killed), timeout=10, what="the rank processes to die")

        done = client.wait(job.id, timeout=90)
    assert done.state is JobState.SUCCEEDED, done
    assert done.attempt == 2, done

    # -- the ledger: one NODE_LOST failure, the second attempt restarted from the last committed step ------------
    assert ledger.node_state(victim) == "LOST"
    row = ledger.job(job.id)
    assert (row["failures"], row["preemptions"]) == (1, 0)
    first, second = ledger.attempts(job.id)
    assert first["outcome"] == "NODE_LOST" and victim in first["reason"], dict(first)
    # The survivor cannot commit alone (a checkpoint needs every rank): the last commit is the one at the kill
    # (or, at worst, one whose dead rank had reported its shard just before).
    last = max(r["step"] for r in ledger.committed(job.id, 1))
    assert first["committed_step"] == last >= committed_at_kill >= 20, (dict(first), last, committed_at_kill)
    assert second["outcome"] == "SUCCEEDED" and second["restored_step"] == first["committed_step"], dict(second)
    second_nodes = ledger.attempt_nodes(job.id, 2)
    assert set(second_nodes.values()) == set(cluster.node_names) - {victim}, second_nodes

    # -- the ranks: both restored that step and counted exactly `steps` ----------------------------------------
    results = _results(out, job.id, 2)
    for r, res in enumerate(results):
        assert res == dict(rank=r, count=steps, step=steps, attempt=2, restored_step=last, node=second_nodes[r]), res
    starts = sorted(
        (e["attempt"], e["rank"], e["restored_step"]) for e in _events(out, job.id) if e["event"] == "start"
    )
    assert starts == [(1, 0, -1), (1, 1, -1), (2, 0, last), (2, 1, last)], starts


def test_preempted_gang_checkpoints_and_resumes_without_losing_a_committed_step(cluster_factory, tmp_path):
    steps, every = 60, 20
    out = tmp_path / "out"
    cluster = cluster_factory(2, min_runtime=1.0, preemption_grace=10.0)
    ledger = Ledger(cluster)
    with Client(cluster.address, timeout=10) as client:
        # every=20: the preemption's checkpoint (about a step after the request) is far from the next periodic one,
        # which the victim's ranks must not reach before they are stopped (see the restored_step check below).
        low = client.submit("count-steps", 2, 8, _command(steps, out, every), procs_per_replica=1, env=ENV)
        low = client.wait(low.id, ["RUNNING"], timeout=30)
        # Past its minimum runtime (1 s) and with a periodic checkpoint committed; then a gang that needs its GPUs.
        eventually_sync(
            lambda: ledger.latest_step(low.id) >= every, timeout=90, what="the first periodic checkpoint", interval=0.05
        )
        periodic = ledger.latest_step(low.id)
        asked_at = time.time()
        high = client.submit("urgent", 1, 8, ["sleep", "2"], priority=100)

        # PREEMPTING: still RUNNING with its GPUs, a preemptor named, a checkpoint requested.
        # Polled in the ledger, often: it lasts only until the checkpoint commits (about a second here).
        def preempting():
            row = ledger.job(low.id)
            return row if row["state"] == "RUNNING" and row["preempted_by"] == high.id else None

        seen = eventually_sync(preempting, timeout=20, what="the victim to be PREEMPTING", interval=0.02)
        assert seen["preempt_deadline"] > asked_at
        high_done = client.wait(high.id, timeout=60)
        assert high_done.state is JobState.SUCCEEDED, high_done

    row = eventually_sync(
        lambda: (r := ledger.job(low.id))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and r,
        timeout=60,
        what="the victim to finish",
    )
    assert row["state"] == "SUCCEEDED", dict(row)
    assert (row["attempt"], row["preemptions"], row["failures"]) == (2, 1, 0), dict(row)

    first, second = ledger.attempts(low.id)
    assert first["outcome"] == "PREEMPTED", dict(first)
    assert "its checkpoint is committed" in first["reason"], dict(first)  # not the end of the grace period
    committed = first["committed_step"]
    assert committed >= periodic, (committed, periodic)
    # The checkpoint the victim stopped at was begun after the preemptor arrived: the preemption's checkpoint.
    (ckpt,) = [c for c in ledger.committed(low.id, 1) if c["step"] == committed]
    assert ckpt["created_at"] >= asked_at, dict(ckpt)
    if committed % every:
        assert any(
            e["event"] == "checkpoint" and e["attempt"] == 1 and e["step"] == committed and e["requested"]
            for e in _events(out, low.id)
        )
    # The preemptor ran on the GPUs the victim gave up, between the victim's two attempts.
    assert first["ended_at"] <= high_done.started_at
    assert second["reserved_at"] >= high_done.finished_at - 0.5  # (clocks of one host; finished_at is the report)
    # No committed step lost: attempt 2 restarted from attempt 1's last committed step. (The coordinator fences on
    # jobs.attempt only, so ranks of a torn-down attempt can still commit until the next attempt is reserved; this
    # equality relies on them being stopped before their next periodic checkpoint.)
    assert second["restored_step"] == committed, (
        dict(first),
        dict(second),
        [dict(c) for c in ledger.committed(low.id)],
    )
    assert second["outcome"] == "SUCCEEDED"

    results = _results(out, low.id, 2)
    for res in results:
        assert (res["count"], res["step"], res["attempt"], res["restored_step"]) == (steps, steps, 2, committed), res
    starts = sorted(
        (e["attempt"], e["rank"], e["restored_step"]) for e in _events(out, low.id) if e["event"] == "start"
    )
    assert starts == [(1, 0, -1), (1, 1, -1), (2, 0, committed), (2, 1, committed)], starts
