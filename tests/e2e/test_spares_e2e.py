"""Spares kept in the domain end to end on `LocalCluster` (real scheduler, checkpoint coordinator and simulated agents
as processes, SQLite), on a two-domain fabric: 6 nodes, NVLink domains nvl0 and nvl1 of 3 nodes each.

The sample program `phalanx.examples.count_steps` runs as a 2-segment gang of 2 whole-node replicas with 1 spare per
segment (the whole cluster). A node of segment 1 dies (its agent and its rank SIGKILLed): within a few seconds the
gang restarts on the spare of that domain, every other rank on its node, from the last committed step, and ends
with exactly the expected count; a pending gang that would fit the slot never starts meanwhile.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from helpers.local_clusters import eventually_sync
from test_recovery_e2e import ENV, Ledger, _alive, _command, _rank_processes, _results

from phalanx.client import Client, JobState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc"),
]

FABRIC = """\
tiers: [leaf]
switches:
  leaf0: ["node-[01-06]"]
nvlink_domains:
  nvl0: "node-[01-03]"
  nvl1: "node-[04-06]"
"""


def test_a_dead_node_is_swapped_for_the_spare_of_its_domain_without_a_requeue(cluster_factory, tmp_path):
    steps = 80
    out = tmp_path / "out"
    fabric = tmp_path / "fabric.yaml"
    fabric.write_text(FABRIC)
    cluster = cluster_factory(6, fabric=fabric)
    ledger = Ledger(cluster)
    with Client(cluster.address, timeout=10) as client:
        job = client.submit(
            "spared",
            4,
            8,
            _command(steps, out),
            procs_per_replica=1,
            env=ENV,
            segment=2,
            spares_per_segment=1,
        )
        job = client.wait(job.id, ["RUNNING"], timeout=30)
        first_nodes = ledger.attempt_nodes(job.id, 1)
        spares = {s.segment: s.node for s in job.spares}
        assert sorted(first_nodes) == [-2, -1, 0, 1, 2, 3] and set(spares.values()) == {
            first_nodes[-1],
            first_nodes[-2],
        }
        waiter = client.submit("waiter", 1, 8, ["sleep", "1"])  # would fit the dead node's slot
        eventually_sync(
            lambda: ledger.latest_step(job.id) >= 20, timeout=90, what="a checkpoint >= step 20", interval=0.05
        )

        # -- a node of segment 1 dies: its agent, then every rank process on it -----------------------------------
        victim = first_nodes[2]
        cluster.kill_agent(victim)
        killed_at = time.monotonic()
        killed = _rank_processes(job.id, victim)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        eventually_sync(lambda: not any(_alive(p) for p in killed), timeout=10, what="the rank processes to die")

        swapped = eventually_sync(
            lambda: (j := client.get_job(job.id)).attempt == 2 and j.state is JobState.RUNNING and j,
            timeout=30,
            what="the gang restarted on its spare",
        )
        swap_s = time.monotonic() - killed_at
        assert client.get_job(waiter.id).state is JobState.PENDING
        done = client.wait(job.id, timeout=120)
        w = client.get_job(waiter.id)  # never started while the gang held the domain: at most once it ended
        assert w.attempt == 0 or (w.attempt == 1 and w.started_at >= done.finished_at - 0.01), (w, done)
    assert done.state is JobState.SUCCEEDED, done
    assert done.attempt == 2 and done.failures == 0 and done.swaps == 1, done
    print(f"swap: {swap_s:.1f}s from the kill to attempt 2 RUNNING (lease {cluster.lease_timeout}s)")

    second_nodes = ledger.attempt_nodes(job.id, 2)
    assert second_nodes[2] == spares[1]  # the spare of the dead node's domain
    assert {r: n for r, n in second_nodes.items() if r in (0, 1, 3)} == {r: first_nodes[r] for r in (0, 1, 3)}
    first, second = ledger.attempts(job.id)
    assert first["outcome"] == "NODE_LOST" and second["restored_step"] == first["committed_step"] >= 20
    results = _results(out, job.id, 4)
    for res in results:
        assert res["count"] == steps and res["attempt"] == 2 and res["restored_step"] == first["committed_step"]
    assert swapped.attempt == 2
