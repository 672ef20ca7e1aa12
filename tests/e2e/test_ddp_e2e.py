"""A real distributed training job on a local cluster, preempted and resumed (needs torch: skips without it, fails in CI).

`phalanx.examples.ddp_tiny` (torch.distributed over gloo, DistributedDataParallel, collective DCP checkpoints
through phalanx.train) runs as a 2-node x 2-rank gang on `LocalCluster` (real scheduler, checkpoint coordinator
and simulated agents as processes, SQLite). The four ranks span both nodes: a filler gang holds 6 of the 8 GPUs
of each of the first two nodes, and the other two nodes are drained, so only 2 + 2 GPUs are free. A critical gang
then needs exactly those GPUs: the trainer is asked to checkpoint (PREEMPTING), every rank saves at one agreed
step, the checkpoint commits, the trainer stops and the critical gang runs. The drained nodes come back, the
trainer resumes there from the committed step, and it ends with parameters bit-identical to an uninterrupted run
of the same seed (run beside it, by hand, without Phalanx).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.local_clusters import eventually_sync as _eventually
from helpers.ports import reserved_port
from helpers.required import needs, torch_missing
from test_recovery_e2e import Ledger

from phalanx.cli.cluster import LocalCluster
from phalanx.client import Client, JobState
from phalanx.core.preemption import parse_priority

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="local cluster processes"),
    needs("torch", torch_missing()),
]

STEPS = 120
STEP_TIME = 0.05  # 6 s or more of training: the preemption lands in the middle of it
# One intra-op thread per rank, as torchrun gives each of several ranks on a host: this host runs the four ranks (and
# the suite's other workers) on a few cores, where torch's default pool of one spinning OpenMP thread per core in
# every rank oversubscribes them: a step then took 0.2 s instead of 0.01 s, and the test ran past its time limit.
THREADS = {"OMP_NUM_THREADS": "1"}
ENV = {"PHALANX_CHECKPOINT_POLL_S": "0.2", **THREADS}


def _command(out: Path, step_time: float = STEP_TIME) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx.examples.ddp_tiny",
        "--steps",
        str(STEPS),
        "--step-time",
        str(step_time),
        "--out",
        str(out),
        "--timeout",
        "90",
    ]


def _uninterrupted(out: Path, world: int = 4) -> set[str]:
    """The same training by hand: `world` local ranks, no Phalanx, no checkpoints."""
    port = reserved_port()  # rank 0's TCPStore binds it only once torch starts: no port-0 bind may take it first
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        env.update(
            THREADS,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % 2),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen(_command(out, 0.0), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:  # say where every rank was (CI once saw this run hang, cause unknown)
            for q in procs:
                q.kill()
            said = [f"rank {r}:\n{q.communicate()[0].decode()[-1500:]}" for r, q in enumerate(procs)]
            raise AssertionError("the baseline did not end in 150 s\n" + "\n".join(said)) from None
        assert p.returncode == 0, f"baseline rank {rank} exited {p.returncode}:\n{text.decode()[-2000:]}"
    return {json.loads((out / "local" / f"rank-{r}.json").read_text())["params_sha256"] for r in range(world)}


def _events(out: Path, job_id: str) -> list[dict]:
    path = out / job_id / "events.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_ddp_gang_is_preempted_resumes_elsewhere_and_ends_bit_identical(tmp_path, monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_DB", raising=False)
    out = tmp_path / "out"
    cluster = LocalCluster(
        nodes=4,
        state_dir=tmp_path / "cluster",
        port=0,
        log=lambda _m: None,
        ready_timeout=60,
        restart_agents=False,
        mig_gpus=0,
        min_runtime=1.0,
        preemption_grace=60.0,
    )
    cluster.start()
    try:
        ledger = Ledger(cluster)
        first_nodes, spare = cluster.node_names[:2], cluster.node_names[2:]
        with Client(cluster.address, timeout=10) as client:
            for name in spare:
                client.drain_node(name, "kept free for the trainer's second attempt")
            filler = client.submit("filler", 2, 6, ["sleep", "600"], procs_per_replica=1, priority=50)
            client.wait(filler.id, ["RUNNING"], timeout=30)
            trainer = client.submit("ddp-tiny", 2, 2, _command(out), priority=parse_priority("batch"), env=ENV)
            trainer = client.wait(trainer.id, ["RUNNING"], timeout=30)
            assert set(ledger.attempt_nodes(trainer.id, 1).values()) == set(first_nodes)
            _eventually(
                lambda: len([e for e in _events(out, trainer.id) if e["event"] == "start"]) == 4,
                timeout=90,
                what="the trainer's four ranks to start training",
            )

            critical = client.submit(
                "critical", 2, 2, ["sleep", "600"], procs_per_replica=1, priority=parse_priority("critical")
            )
            _eventually(
                lambda: (a := ledger.attempts(trainer.id)) and a[0]["outcome"] == "PREEMPTED" and a,
                timeout=90,
                what="the trainer to checkpoint and stop",
            )
            client.wait(critical.id, ["RUNNING"], timeout=30)
            assert set(ledger.attempt_nodes(critical.id, 1).values()) == set(first_nodes)
            for name in spare:
                client.undrain_node(name)
            done = client.wait(trainer.id, timeout=150)
            assert done.state is JobState.SUCCEEDED, done
            client.cancel(critical.id)
            client.cancel(filler.id)

        baseline = _uninterrupted(tmp_path / "baseline")
        assert len(baseline) == 1  # DDP keeps the replicas equal
        first, second = ledger.attempts(trainer.id)[:2]
        assert "its checkpoint is committed" in first["reason"], dict(first)
        committed = first["committed_step"]
        assert 0 < committed < STEPS, dict(first)
        # Every rank saved at the one agreed step, and the collective checkpoint has one shard per rank.
        saves = sorted(
            (e["rank"], e["step"]) for e in _events(out, trainer.id) if e["event"] == "checkpoint" and e["attempt"] == 1
        )
        assert saves == [(r, committed) for r in range(4)], saves
        (ckpt,) = [c for c in ledger.committed(trainer.id, 1) if c["step"] == committed]
        shards = ledger.rows(
            "SELECT rank, uri FROM checkpoint_shards WHERE checkpoint_id = ? ORDER BY rank", ckpt["id"]
        )
        assert [(s["rank"], s["uri"].rsplit("#", 1)[1]) for s in shards] == [(r, f"rank-{r}") for r in range(4)]
        # The second attempt ran on the other two nodes, restored the committed step on every rank, and its
        # parameters are bit-identical to the uninterrupted run's.
        assert set(ledger.attempt_nodes(trainer.id, 2).values()) <= set(spare)
        assert second["restored_step"] == committed, dict(second)
        results = [json.loads((out / trainer.id / f"rank-{r}.json").read_text()) for r in range(4)]
        assert [(r["attempt"], r["restored_step"], r["step"]) for r in results] == [(2, committed, STEPS)] * 4
        assert {r["params_sha256"] for r in results} == baseline
        starts = sorted(
            (e["attempt"], e["rank"], e["restored_step"]) for e in _events(out, trainer.id) if e["event"] == "start"
        )
        assert starts == [(1, r, -1) for r in range(4)] + [(2, r, committed) for r in range(4)], starts
    finally:
        cluster.stop()
