"""The trace replay (phalanx/sim/engine.py): each policy's defining behaviour on small crafted workloads."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from phalanx.sim.engine import ClusterSpec, simulate


@dataclass(frozen=True)
class J:
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    duration_s: float
    gpu_milli: int = 0


def test_per_container_scheduling_deadlocks_and_hoards_where_gangs_do_not():
    # Two 3-node gangs arrive together on 4 nodes: pods interleave, each gang gets 2 nodes, neither can start.
    jobs = [J("a", 0, 3, 8, 100), J("b", 0, 3, 8, 100), J("c", 500, 1, 8, 50)]
    pod = simulate(jobs, ClusterSpec.parse("4x8,leaf=2"), "pod").metrics
    assert pod["deadlocked"] is not False and pod["completed"] == 0
    assert pod["hoarded_gpu_hours"] == pytest.approx(32 * 500 / 3600)  # 4 nodes held from t=0 to the last event
    gang = simulate(jobs, ClusterSpec.parse("4x8,leaf=2"), "gang-fifo").metrics
    assert gang["completed"] == 3 and gang["hoarded_gpu_hours"] == 0 and gang["deadlocked"] is False


def test_backfill_raises_utilisation_and_cuts_waits_against_strict_fifo():
    # A long 3-node gang runs; a 4-node gang waits for it; small short jobs behind it fill the idle node.
    jobs = [J("long", 0, 3, 8, 1000), J("big", 1, 4, 8, 100)] + [J(f"s{i}", 2 + i, 1, 8, 100) for i in range(8)]
    fifo = simulate(jobs, ClusterSpec.parse("4x8,leaf=4"), "gang-fifo").metrics
    easy = simulate(jobs, ClusterSpec.parse("4x8,leaf=4"), "gang-backfill").metrics
    assert easy["completed"] == fifo["completed"] == 10
    assert easy["queue_delay_mean_h"] < fifo["queue_delay_mean_h"]
    assert easy["idle_gpu_hours_while_jobs_wait"] < fifo["idle_gpu_hours_while_jobs_wait"]


def test_topology_awareness_keeps_gangs_inside_a_leaf():
    rng = random.Random(3)
    jobs = [J(f"j{i}", i * 30.0, rng.choice([1, 2, 4]), 8, rng.uniform(200, 600)) for i in range(120)]
    cluster = ClusterSpec.parse("32x8,leaf=4")
    aware = simulate(jobs, cluster, "topo").metrics
    blind = simulate(jobs, cluster, "gang-backfill").metrics
    assert aware["within_one_leaf"] > blind["within_one_leaf"]
    assert aware["leaf_crossings_per_multi_node_gang"] < blind["leaf_crossings_per_multi_node_gang"]


def test_checkpoint_restart_loses_less_than_restart_from_scratch():
    jobs = [J(f"j{i}", 0, 2, 8, 20 * 3600) for i in range(4)]  # long jobs, many failures
    cluster = ClusterSpec.parse("8x8,leaf=4")
    kw = dict(failures_per_gpu_day=0.05, repair_s=600, seed=5)
    ckpt = simulate(jobs, cluster, "topo", checkpoint="young-daly", **kw).metrics
    scratch = simulate(jobs, cluster, "topo", checkpoint="none", **kw).metrics
    assert ckpt["completed"] == scratch["completed"] == 4
    assert ckpt["goodput"]["rollback"] < scratch["goodput"]["rollback"]
    assert ckpt["makespan_h"] < scratch["makespan_h"]


def test_fractional_gpus_pack_small_jobs_under_topo_mig():
    jobs = [J(f"f{i}", 0, 1, 1, 100, gpu_milli=250) for i in range(32)]
    whole = simulate(jobs, ClusterSpec.parse("1x8"), "topo").metrics
    shared = simulate(jobs, ClusterSpec.parse("1x8"), "topo-mig").metrics
    assert whole["makespan_h"] == pytest.approx(4 * 100 / 3600)  # 32 jobs, 8 at a time
    assert shared["makespan_h"] == pytest.approx(100 / 3600)     # all 32 at once, 4 per GPU


def test_cluster_specs_and_policies_are_validated():
    assert ClusterSpec.parse("64x8,leaf=16,spine=4") == ClusterSpec(64, 8, 16, 4)
    for bad in ("", "x8", "4x8,leaf=0", "4x8,rack=2"):
        with pytest.raises(ValueError, match="NODESxGPUS|>= 1"):
            ClusterSpec.parse(bad)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate([], ClusterSpec.parse("1x8"), "magic")


def test_network_contention_slows_gangs_across_an_oversubscribed_uplink_and_topology_avoids_it():
    from phalanx.sim.network import NetworkSpec

    # 2-node gangs on 4 leaves of 2 nodes, 4:1 oversubscribed: placed blind, the first ones already cross leaves.
    jobs = [J(f"g{i}", 0, 2, 8, 1000) for i in range(4)]
    cluster = ClusterSpec.parse("8x8,leaf=2,oversub=4")
    net = NetworkSpec(oversubscription=4)
    aware = simulate(jobs, cluster, "topo", network=net).metrics
    flat = simulate(jobs, cluster, "topo").metrics
    assert aware["within_one_leaf"] == 1.0 and aware["cross_spine_tb"] == 0
    assert aware["makespan_h"] == pytest.approx(flat["makespan_h"])  # inside leaves the network costs nothing extra
    # Interleaved placements (a per-node scheduler) cross leaves and share the uplinks: every gang is slower.
    pods = simulate(jobs, cluster, "pod", network=net).metrics
    assert pods["makespan_h"] > aware["makespan_h"] and pods["cross_spine_tb"] > 0


def test_a_gang_slows_while_another_shares_its_uplink_and_speeds_up_when_it_leaves():
    from phalanx.sim.network import NetworkSpec

    # Two nodes, each its own leaf, 8:1 oversubscribed. A 2 x 6 and a 2 x 2 gang each need both nodes, so both
    # cross the same two uplinks: while both run each gets half; when the short one ends the other speeds up.
    cluster = ClusterSpec.parse("2x8,leaf=1,oversub=8")
    net = NetworkSpec(oversubscription=8)
    alone = simulate([J("a", 0, 2, 6, 1000)], cluster, "pod", network=net).metrics["makespan_h"] * 3600
    result = simulate([J("a", 0, 2, 6, 1000), J("b", 0, 2, 2, 300)], cluster, "pod", network=net)
    both, both_jct = result.metrics, result.jct
    # By hand (communication is 20% of a step on the best placement of the shape; 6 and 2 NICs per node at 50 GB/s;
    # each leaf's uplink carries 8 x 50 / 8 = 50 GB/s): alone, "a" gets 50 of its 300 GB/s, comm 6x, step 2.0x: 2,000
    # s. Together they get 25 GB/s each: "b" runs at 1/1.6 and ends at 480 s; "a" did 150 s of work by then at
    # 1/3.2, and the remaining 850 s at 1/2.0: 2,180 s.
    assert alone == pytest.approx(2000.0)
    assert sorted(both_jct) == pytest.approx([480.0, 2180.0])
    assert both["makespan_h"] * 3600 == pytest.approx(2180.0)


@dataclass(frozen=True)
class T:
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    duration_s: float
    tenant: str
    gpu_milli: int = 0


def test_quotas_and_fair_share_keep_a_flooding_tenant_from_starving_the_others():
    from phalanx.sim.engine import equal_quotas

    jobs = [T(f"f{i}", 0, 1, 8, 100, "flood") for i in range(40)] + [T(f"l{i}", 1, 1, 8, 100, "late")
                                                                     for i in range(4)]
    cluster = ClusterSpec.parse("4x8,leaf=4")
    fifo = simulate(jobs, cluster, "topo").metrics["tenants"]
    fair = simulate(jobs, cluster, "topo", quotas=equal_quotas(jobs, 32)).metrics["tenants"]
    assert fifo["late"]["queue_delay_mean_h"] * 3600 >= 900  # behind all 40 of the flood
    assert fair["late"]["queue_delay_mean_h"] * 3600 <= 150  # its share comes first once GPUs free up
    assert fair["late"]["quota_share"] == fair["flood"]["quota_share"] == 0.5
    assert fair["flood"]["completed"] == 40 and fair["late"]["completed"] == 4
