"""End to end with real processes: `LocalCluster` (scheduler, checkpoint coordinator, three simulated agents) on
SQLite runs a 2 x 8 gang whose ranks are real Python processes, survives the SIGKILL of an agent (the node goes
LOST, the rest keeps working), and leaves no process behind when stopped."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from phalanx.cli.cluster import LocalCluster
from phalanx.cli.main import main as cli_main
from phalanx.client import Client, JobState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# The documented JSON shapes of `phalanx jobs --json` and `phalanx nodes --json` (README, Job/Node.to_dict).
JOB_FIELDS = {
    # issue 34: segments, spares, elastic gangs, job graphs
    "after",
    "array",
    "array_parent",
    "array_spec",
    "array_task",
    "current_replicas",
    "last_swap",
    "last_swap_at",
    "min_replicas",
    "segment",
    "segment_domains",
    "segment_tier",
    "spares",
    "spares_per_segment",
    "swaps",
    "waiting_for",
    "id",
    "claim",
    "name",
    "state",
    "replicas",
    "gpus_per_replica",
    "cpus_per_replica",
    "memory_per_replica",
    "priority",
    "procs_per_replica",
    "command",
    "env",
    "allocations",
    "attempt",
    "message",
    "exit_code",
    "submitted_at",
    "started_at",
    "finished_at",
    "placement",
    "required_tier",
    "preferred_tier",
    "gpu_model",
    "mig_profile",
    "gpu_milli",
    "failures",
    "preemptions",
    "not_before",
    "preempted_by",
    "preempt_deadline",
    "goodput",
    "max_restarts",
    "time_limit",
    "tenant",
    "queue",
    "flavor",
    "struck_nodes",
    "restore",
    "service",  # serving (issue 33): the service a job is a replica of, its index, revision and readiness
    "service_replica",
    "service_revision",
    "ready",
    "keep_checkpoints",
}
NODE_FIELDS = {
    "name",
    "gpus",
    "free_gpus",
    "state",
    "profile",
    "gpu_model",
    "fabric_path",
    "message",
    "last_heartbeat",
    "address",
    "shared_gpus",
    "health",
    "health_reason",
    "unhealthy_gpus",
    "gpu_details",
    "strikes",
    "mig_manage",
    "containment",
    "releasing_gpus",
    "cpus",
    "memory_bytes",
    "free_cpus",
    "free_memory_bytes",
}
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "CUDA_VISIBLE_DEVICES",
    "PHALANX_NODE",
    "MASTER_ADDR",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "PHALANX_GPU_MILLI",
    "PHALANX_CHECKPOINT_ADDR",
    "PHALANX_CHECKPOINT_DIR",
)

# A rank that saves a shard through phalanx.train, waits for the checkpoint to commit (every rank's shard in), and
# writes what restore() returns.
TRAIN_PROGRAM = (
    "import json, os, time\n"
    "from phalanx import train\n"
    "rank = int(os.environ['RANK'])\n"
    "train.save(7, {'rank': rank, 'weights': [rank] * 3})\n"
    "deadline = time.time() + 30\n"
    "got = train.restore()\n"
    "while got is None and time.time() < deadline:\n"
    "    time.sleep(0.1)\n"
    "    got = train.restore()\n"
    "path = os.path.join(os.environ['OUT_DIR'], 'restored-%d.json' % rank)\n"
    "with open(path, 'w') as f:\n"
    "    json.dump(None if got is None else [got[0], got[1]], f)\n"
)

RANK_PROGRAM = (
    "import json, os\n"
    f"keys = {ENV_KEYS!r}\n"
    "path = os.path.join(os.environ['OUT_DIR'], 'rank-%s.json' % os.environ['RANK'])\n"
    "with open(path + '.tmp', 'w') as f:\n"
    "    json.dump({k: os.environ.get(k) for k in keys}, f)\n"
    "os.replace(path + '.tmp', path)\n"
)


def _cli_json(capsys, address: str, *argv: str):
    code = cli_main(["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # stdout is exactly one JSON document


def _ledger_allocations(state_dir: Path, job_id: str) -> list[tuple]:
    """The allocation rows of a job from the cluster's SQLite ledger, its history (a job that is not running shows
    no allocations): (replica, node, GPU, kind, unit, profile, gpu_milli), the GPUs' hold rows left out."""
    import sqlite3

    with sqlite3.connect(state_dir / "phalanx.db") as conn:
        return conn.execute(
            "SELECT a.replica, n.name, a.gpu_index, a.kind, a.unit, a.profile, a.gpu_milli FROM allocations a "
            "JOIN nodes n ON n.id = a.node_id WHERE a.job_id = ? AND a.kind != 'hold' ORDER BY a.replica, a.unit",
            (job_id,),
        ).fetchall()


def _eventually(check, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def _processes_of(state_dir: Path) -> list[str]:
    """Live processes that belong to this cluster: its state dir on their command line or as PHALANX_HOME."""
    marker = str(state_dir).encode()
    home = b"PHALANX_HOME=" + marker
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes() if os.access(entry / "environ", os.R_OK) else b""
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :].startswith("Z"):
            continue
        if marker in cmdline or home in environ.split(b"\0"):
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {shown}")
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_local_cluster_runs_a_gang_survives_an_agent_kill_and_stops_clean(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_DB", raising=False)
    state_dir = tmp_path / "cluster"
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    messages: list[str] = []
    cluster = LocalCluster(nodes=3, state_dir=state_dir, port=0, log=messages.append, ready_timeout=60)
    try:
        cluster.start()
        assert (state_dir / "phalanx.db").exists() and (state_dir / "topology.conf").exists()
        with Client(cluster.address, timeout=10) as client:
            nodes = client.nodes()
            assert sorted(n.name for n in nodes) == ["node-01", "node-02", "node-03"]
            assert all(n.state.value == "READY" and n.gpus == 8 for n in nodes)
            # by default the last GPU of the last node is in MIG mode (the cluster's MIG jobs go there)
            assert {n.name: n.mig_gpus for n in nodes} == {"node-01": [], "node-02": [], "node-03": [7]}

            # -- a 2 x 8 gang of real processes ------------------------------------------------------------------
            job = client.submit("e2e-gang", 2, 8, [sys.executable, "-c", RANK_PROGRAM], env={"OUT_DIR": str(out_dir)})
            done = client.wait(job.id, timeout=60)
            assert done.state is JobState.SUCCEEDED, done
            assert done.allocations == [] and done.nodes == ()  # finished: it holds no GPUs
            placed = {rep: node for rep, node, *_ in _ledger_allocations(state_dir, job.id)}
            assert len(placed) == 2 and len(set(placed.values())) == 2

        envs = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(16)]
        assert sorted(int(e["RANK"]) for e in envs) == list(range(16))
        assert {e["WORLD_SIZE"] for e in envs} == {"16"}
        by_node: dict[str, list[dict]] = {}
        for e in envs:
            by_node.setdefault(e["PHALANX_NODE"], []).append(e)
        assert set(by_node) == set(placed.values())
        for node, ranks in by_node.items():
            assert len(ranks) == 8, node
            devices = [e["CUDA_VISIBLE_DEVICES"] for e in ranks]
            assert len(set(devices)) == 8, (node, devices)  # one distinct GPU per rank on each node
            assert sorted(int(e["LOCAL_RANK"]) for e in ranks) == list(range(8))
        for e in envs:
            assert placed[int(e["NODE_RANK"])] == e["PHALANX_NODE"]

        # -- `phalanx jobs --json`: one page object, its jobs with the documented fields ---------------------------
        page = _cli_json(capsys, cluster.address, "jobs", "--json")
        assert set(page) == {"jobs", "next_page_token"} and page["next_page_token"] == ""
        jobs = page["jobs"]
        assert isinstance(jobs, list) and len(jobs) == 1  # (the partial-GPU jobs come after this check)
        (row,) = jobs
        assert set(row) == JOB_FIELDS
        assert row["id"] == job.id and row["state"] == "SUCCEEDED" and row["exit_code"] == 0
        assert (row["replicas"], row["gpus_per_replica"]) == (2, 8)
        assert row["allocations"] == []  # a finished job shows no allocations

        # -- partial GPUs on the simulated DGX H100s: a MIG instance and two quarter-GPU shares ---------------------
        with Client(cluster.address, timeout=10) as client:
            program = [sys.executable, "-c", RANK_PROGRAM]
            mig_dir, share_dir = tmp_path / "mig", tmp_path / "shares"
            mig_dir.mkdir()
            share_dir.mkdir()
            mig_job = client.submit("e2e-mig", 1, 1, program, env={"OUT_DIR": str(mig_dir)}, mig_profile="3g.40gb")
            share_job = client.submit("e2e-share", 2, 1, program, env={"OUT_DIR": str(share_dir)}, gpu_milli=250)
            mig_done = client.wait(mig_job.id, timeout=60)
            share_done = client.wait(share_job.id, timeout=60)
        assert mig_done.state is JobState.SUCCEEDED and share_done.state is JobState.SUCCEEDED, (mig_done, share_done)
        mig_rows = _ledger_allocations(state_dir, mig_job.id)  # one row per memory slice of the instance
        assert {(kind, profile) for _, _, _, kind, _, profile, _ in mig_rows} == {("mig", "3g.40gb")}
        assert sorted(unit for *_, unit, _, _ in mig_rows) == [4, 5, 6, 7]  # start 4, size 4
        mig_env = json.loads((mig_dir / "rank-0.json").read_text())
        assert mig_env["CUDA_VISIBLE_DEVICES"].startswith("MIG-"), mig_env  # the instance's MIG device UUID
        share_envs = [json.loads((share_dir / f"rank-{r}.json").read_text()) for r in range(2)]
        for e in share_envs:
            assert (e["PHALANX_GPU_MILLI"], e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == ("250", "25"), e
            assert e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20389M", e  # a quarter of 81,559 MiB
        share_rows = _ledger_allocations(state_dir, share_job.id)
        assert [milli for *_, milli in share_rows] == [250, 250]
        assert len({(node, gpu) for _, node, gpu, *_ in share_rows}) == 1  # both quarters on one GPU

        # -- phalanx.train through the local cluster: ranks find the coordinator and the store the scheduler gives --
        assert envs[0]["PHALANX_CHECKPOINT_ADDR"] == cluster.checkpoint_address
        assert envs[0]["PHALANX_CHECKPOINT_DIR"] == str(state_dir / "checkpoints")
        train_dir = tmp_path / "train"
        train_dir.mkdir()
        with Client(cluster.address, timeout=10) as client:
            trained = client.submit(
                "e2e-train", 1, 2, [sys.executable, "-c", TRAIN_PROGRAM], env={"OUT_DIR": str(train_dir)}
            )
            trained = client.wait(trained.id, timeout=60)
        assert trained.state is JobState.SUCCEEDED, trained
        for r in range(2):
            step, state = json.loads((train_dir / f"restored-{r}.json").read_text())
            assert (step, state) == (7, {"rank": r, "weights": [r] * 3})  # each rank gets its own shard back

        # -- SIGKILL one agent: a node failure, not the end of the cluster -------------------------------------
        victim = next(n for n in cluster.node_names if n not in placed.values())
        cluster.kill_agent(victim)
        _eventually(lambda: cluster.agents[victim].exit_code is not None, timeout=10, what="the monitor to notice")
        assert any(victim in m and "node failure" in m for m in messages), messages
        survivors = [p for p in cluster.children() if p.name != victim]
        assert all(p.alive() for p in survivors), [(p.name, p.proc.returncode) for p in survivors]

        def victim_lost():
            nodes = _cli_json(capsys, cluster.address, "nodes", "--json")
            assert all(set(n) == NODE_FIELDS for n in nodes)
            # Each agent said how it contains its ranks (cgroups as root, else the process-group fallback).
            assert all(n["containment"] in ("cgroup-v2", "cgroup-v1", "process-group") for n in nodes), nodes
            states = {n["name"]: n["state"] for n in nodes}
            return states if states.get(victim) == "LOST" else None

        states = _eventually(victim_lost, timeout=30, what=f"{victim} to be LOST")
        assert all(states[n] == "READY" for n in cluster.node_names if n != victim), states
        assert cluster.running and cluster.failed_service is None

        with Client(cluster.address, timeout=10) as client:  # the rest still takes work
            after = client.submit("after-loss", 1, 8, [sys.executable, "-c", "pass"])
            after = client.wait(after.id, timeout=60)
            assert after.state is JobState.SUCCEEDED, after
            assert victim not in after.nodes
    finally:
        cluster.stop()

    # -- nothing is left behind ----------------------------------------------------------------------------------
    assert all(not p.alive() for p in cluster.children())
    deadline = time.monotonic() + 10
    while _processes_of(state_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(state_dir) == []
    assert not (state_dir / "cluster.json").exists()
