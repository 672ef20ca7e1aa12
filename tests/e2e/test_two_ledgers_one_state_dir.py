"""End to end: two local clusters one after the other in one state directory, each on a fresh ledger. The agents of
the second find state of the first ledger (same node names, higher acked revisions) and start clean: a gang
submitted to the second cluster runs and succeeds instead of timing out in launch forever."""

from __future__ import annotations

import json
import sys

import pytest

from db.migrate import cluster_id
from phalanx.cli.cluster import LocalCluster
from phalanx.client import Client, JobState

pytestmark = pytest.mark.timeout(120)

NODES = ("node-01", "node-02")
# A rank: appends its ledger-specific tag to a file of its own.
PROGRAM = [
    sys.executable,
    "-c",
    "import os; open(os.path.join(os.environ['OUT_DIR'], os.environ['RANK']), 'a').write(os.environ['TAG'])",
]


def _states(state_dir) -> dict[str, dict]:
    return {n: json.loads((state_dir / "agents" / n / "state.json").read_text()) for n in NODES}


def _run_gang(cluster: LocalCluster, name: str, out_dir, tag: str, timeout: float):
    with Client(cluster.address, timeout=10) as client:
        # one replica per node (8 GPUs each), one process per replica: two ranks
        job = client.submit(name, 2, 8, PROGRAM, env={"OUT_DIR": str(out_dir), "TAG": tag}, procs_per_replica=1)
        return client.wait(job.id, timeout=timeout)


def test_a_second_ledger_in_the_same_state_dir_runs_its_gangs(tmp_path, monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_DB", raising=False)
    state_dir = tmp_path / "cluster"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    first_db, second_db = f"sqlite:///{state_dir / 'first.db'}", f"sqlite:///{state_dir / 'second.db'}"
    common = dict(nodes=len(NODES), state_dir=state_dir, port=0, mig_gpus=0, ready_timeout=60, log=lambda _: None)

    with LocalCluster(db_url=first_db, **common) as first:
        done = _run_gang(first, "first", out_dir, "a", timeout=30)  # each agent takes revision 1 of this ledger
        assert done.state is JobState.SUCCEEDED, done
    first_id = cluster_id(first_db)
    before = _states(state_dir)
    assert all(s["cluster_id"] == first_id and s["acked_revision"] >= 1 for s in before.values()), before

    with LocalCluster(db_url=second_db, **common) as second:  # a new database, the same node names and state dir
        done = _run_gang(second, "second", out_dir, "b", timeout=20)
        assert done.state is JobState.SUCCEEDED and done.attempt == 1, done
    second_id = cluster_id(second_db)
    assert second_id and second_id != first_id
    assert sorted(p.name for p in out_dir.iterdir()) == ["0", "1"]
    assert all(p.read_text() == "ab" for p in out_dir.iterdir())  # every rank of the second gang ran, once

    after = _states(state_dir)
    for node, state in after.items():
        assert state["cluster_id"] == second_id, node
        # The first ledger's ranks are gone; the second's ended and were reported, so they are dropped too.
        assert {r["job_id"] for r in state["ranks"].values()} <= {done.id}, node
        log = (state_dir / "logs" / f"agent-{node}.log").read_text()
        (line,) = [ln for ln in log.splitlines() if "agent_state_from_another_ledger" in ln]
        assert first_id in line and second_id in line, line
