"""The trace replay (phalanx/sim/engine.py): each policy's defining behaviour on small crafted workloads."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from helpers.required import need

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
    assert shared["makespan_h"] == pytest.approx(100 / 3600)  # all 32 at once, 4 per GPU


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

    jobs = [T(f"f{i}", 0, 1, 8, 100, "flood") for i in range(40)] + [T(f"l{i}", 1, 1, 8, 100, "late") for i in range(4)]
    cluster = ClusterSpec.parse("4x8,leaf=4")
    fifo = simulate(jobs, cluster, "topo").metrics["tenants"]
    fair = simulate(jobs, cluster, "topo", quotas=equal_quotas(jobs, 32)).metrics["tenants"]
    assert fifo["late"]["queue_delay_mean_h"] * 3600 >= 900  # behind all 40 of the flood
    assert fair["late"]["queue_delay_mean_h"] * 3600 <= 150  # its share comes first once GPUs free up
    assert fair["late"]["quota_share"] == fair["flood"]["quota_share"] == 0.5
    assert fair["flood"]["completed"] == 40 and fair["late"]["completed"] == 4


@dataclass(frozen=True)
class P:
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    duration_s: float
    priority: int = 0
    tenant: str = ""
    gpu_milli: int = 0


def test_preemption_checkpoints_the_victim_hands_over_and_the_victim_resumes_with_its_work():
    # One node. "lo" (priority -1, 3,000 s of work) runs from 0; "hi" (priority 10, 1,000 s) arrives at 1,000. It is
    # asked to checkpoint at 1,000, keeps its GPUs for the 60 s checkpoint, and hands over at 1,060: "hi" runs to
    # 2,060, then "lo" resumes with the 2,000 s it had left and ends at 4,060.
    jobs = [P("lo", 0, 1, 8, 3000, priority=-1), P("hi", 1000, 1, 8, 1000, priority=10)]
    cluster = ClusterSpec.parse("1x8")
    result = simulate(jobs, cluster, "topo-preempt", checkpoint_cost_s=60)
    m = result.metrics
    assert result.jct == pytest.approx([1060.0, 4060.0])  # hi: 1,060 after submission; lo: ends at 4,060
    assert m["preemptions"] == 1 and m["reclaims"] == 0
    assert m["preempt_lost_gpu_hours"] == pytest.approx(8 * 60 / 3600)
    g = m["goodput"]
    assert g["productive"] == pytest.approx(8 * (3000 + 1000))  # all the work, once
    assert g["rollback"] == pytest.approx(8 * 60)  # the checkpoint grace
    assert g["allocated"] == pytest.approx(g["productive"] + g["rollback"])
    assert m["priorities"]["-1"]["preempted"] == 1 and m["priorities"]["10"]["preempted"] == 0
    # Without preemption (topo), "hi" waits for "lo" to end.
    plain = simulate(jobs, cluster, "topo", checkpoint_cost_s=60)
    assert plain.jct == pytest.approx([3000.0, 3000.0]) and plain.metrics["preemptions"] == 0
    # topo-mig (f) is (e) plus fractional GPUs: it preempts alike.
    assert simulate(jobs, cluster, "topo-mig", checkpoint_cost_s=60).jct == pytest.approx([1060.0, 4060.0])


def test_preemption_respects_min_runtime_equal_priorities_and_loses_the_work_without_checkpoints():
    cluster = ClusterSpec.parse("1x8")
    # "hi" arrives at 300, "lo" is protected until 600: asked then, handover at 660; "lo" ends at 660 + 1,000 +
    # 2,400.
    early = [P("lo", 0, 1, 8, 3000, priority=-1), P("hi", 300, 1, 8, 1000, priority=10)]
    r = simulate(early, cluster, "topo-preempt", checkpoint_cost_s=60, min_runtime_s=600)
    assert sorted(r.jct) == pytest.approx([1360.0, 4060.0])
    # Equal priorities never preempt each other.
    same = [P("lo", 0, 1, 8, 3000), P("hi", 1000, 1, 8, 1000)]
    assert simulate(same, cluster, "topo-preempt").metrics["preemptions"] == 0
    # Without checkpoints the victim is stopped at once and starts again from scratch: hi runs 1,000-2,000, lo
    # 2,000-5,000; its first 1,000 s on 8 GPUs are lost.
    late = [P("lo", 0, 1, 8, 3000, priority=-1), P("hi", 1000, 1, 8, 1000, priority=10)]
    r = simulate(late, cluster, "topo-preempt", checkpoint="none")
    assert r.jct == pytest.approx([1000.0, 5000.0])
    assert r.metrics["preempt_lost_gpu_hours"] == pytest.approx(8 * 1000 / 3600)
    assert r.metrics["goodput"]["rollback"] == pytest.approx(8 * 1000)


def test_periodic_checkpoints_without_failures_and_preemption_without_the_handshake():
    # One node; no failures, but checkpoints planned for the Llama 3 rate and capped at an hour: "lo" (10,000 s of
    # work) checkpoints after 3,600 s of it (60 s each). "hi" arrives at 5,400.
    jobs = [P("lo", 0, 1, 8, 10000, priority=-1), P("hi", 5400, 1, 8, 1000, priority=10)]
    cluster = ClusterSpec.parse("1x8")
    kw = dict(checkpoint_cost_s=60, planned_failures_per_gpu_day=4.7e-4, max_checkpoint_interval_s=3600)
    # Without the handshake "lo" is stopped at once and keeps the 3,600 s its checkpoint saved (begun at 3,600):
    # 1,800 s on 8 GPUs are lost. "hi" runs 5,400-6,400; "lo" then does its last 6,400 s (one more checkpoint).
    blunt = simulate(jobs, cluster, "topo-preempt", checkpoint_on_preempt=False, **kw)
    assert blunt.jct == pytest.approx([1000.0, 6400.0 + 6400 + 60])
    assert blunt.metrics["preempt_lost_gpu_hours"] == pytest.approx(8 * 1800 / 3600)
    assert blunt.metrics["goodput"]["rollback"] == pytest.approx(8 * 1800)
    # With it, "lo" checkpoints for 60 s and keeps all 5,340 s of its work: only the grace is lost.
    asked = simulate(jobs, cluster, "topo-preempt", **kw)
    assert asked.jct == pytest.approx([1060.0, 6460.0 + 4660 + 60])
    assert asked.metrics["preempt_lost_gpu_hours"] == pytest.approx(8 * 60 / 3600)
    # Without the planned rate there are no periodic checkpoints at all (the default): the handshake keeps all.
    assert simulate(jobs, cluster, "topo-preempt", checkpoint_cost_s=60).jct == pytest.approx([1060.0, 11060.0])


def test_quota_reclaim_evicts_a_gang_running_on_borrowed_quota():
    from phalanx.sim.engine import equal_quotas

    # Two tenants with 8 GPUs of nominal quota each on two nodes. "borrow" runs two 8-GPU gangs (one on quota it
    # borrowed from "owner"); at 1,000 "owner" submits a gang within its nominal quota, of the same priority: it
    # reclaims one node (checkpoint, handover at 1,060, done at 1,560), and the victim resumes then, ending at
    # 1,560 + 4,000.
    jobs = [
        P("b0", 0, 1, 8, 5000, tenant="borrow"),
        P("b1", 0, 1, 8, 5000, tenant="borrow"),
        P("o", 1000, 1, 8, 500, tenant="owner"),
    ]
    cluster = ClusterSpec.parse("2x8")
    quotas = equal_quotas(jobs, 16)
    r = simulate(jobs, cluster, "topo-preempt", quotas=quotas, checkpoint_cost_s=60)
    assert sorted(r.jct) == pytest.approx([560.0, 5000.0, 5560.0])
    assert r.metrics["preemptions"] == r.metrics["reclaims"] == 1
    assert r.metrics["tenants"]["borrow"]["preempted"] == 1
    # Without preemption the owner waits for the borrower's gangs to end; its share of what it was entitled to
    # falls, and so does the fairness index.
    plain = simulate(jobs, cluster, "topo", quotas=quotas)
    assert sorted(plain.jct) == pytest.approx([4500.0, 5000.0, 5000.0])
    assert plain.metrics["tenants"]["owner"]["fair_ratio"] < r.metrics["tenants"]["owner"]["fair_ratio"]
    assert plain.metrics["fairness_jain"] < r.metrics["fairness_jain"] <= 1.0
    # Without quotas there is nothing to reclaim, and equal priorities do not preempt.
    assert simulate(jobs, cluster, "topo-preempt").metrics["preemptions"] == 0


def test_topo_mig_runs_more_fractional_jobs_at_once_than_topo():
    jobs = [P(f"f{i}", 0, 1, 1, 100, gpu_milli=250) for i in range(32)] + [P("big", 0, 1, 8, 50, priority=5)]
    cluster = ClusterSpec.parse("2x8")
    whole = simulate(jobs, cluster, "topo-preempt").metrics
    shared = simulate(jobs, cluster, "topo-mig").metrics
    assert whole["peak_running_jobs"] == 16  # a whole GPU each: 16 at once at most (once the big gang is done)
    assert shared["peak_running_jobs"] == 33  # the big gang and all 32 small ones, four to a GPU
    assert shared["makespan_h"] < whole["makespan_h"]


def test_entitlement_and_jain_index():
    from phalanx.sim.engine import _entitlement, _jain

    # Equal weights over 12 GPUs: one tenant wants only 2, the other two split the rest.
    assert _entitlement({"a": 2, "b": 10, "c": 10}, {"a": 1, "b": 1, "c": 1}, 12) == pytest.approx(
        {"a": 2, "b": 5, "c": 5}
    )
    assert _entitlement({"a": 0, "b": 10}, {"a": 0.5, "b": 0.5}, 8) == pytest.approx({"a": 0, "b": 8})
    assert _entitlement({"a": 10, "b": 10}, {"a": 0.75, "b": 0.25}, 8) == pytest.approx({"a": 6, "b": 2})
    assert _jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert _jain([1.0, 0.0]) == pytest.approx(0.5)


@pytest.mark.slow
def test_the_multi_tenant_mix_trace():
    from collections import Counter

    from phalanx.sim.engine import equal_quotas
    from phalanx.sim.traces import DataNotFound, find_data, load_mix, load_trace

    try:
        data = find_data()
    except DataNotFound as exc:
        need("data", f"trace data folder not found: {exc}")
    need("data", None)
    spec = "mix:teams=3,jobs=40,hours=24,pretrain=2,finetune=100,seed=1"
    jobs = load_trace(spec, data)
    assert jobs == load_mix(data, teams=3, jobs_per_team=40, hours=24, pretrain=2, finetune=100, seed=1)
    assert jobs != load_trace(spec.replace("seed=1", "seed=2"), data)
    kinds = Counter((j.source, j.priority) for j in jobs)
    assert kinds == Counter({("philly", 0): 120, ("mix:pretrain", 100): 2, ("mix:finetune", -100): 100})
    assert len({j.tenant for j in jobs}) == 3 and [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    assert all(j.submit_s <= 24 * 3600 for j in jobs)
    assert all(j.total_gpus in (64, 128, 256) for j in jobs if j.source == "mix:pretrain")
    small = [j for j in jobs if j.source == "mix:finetune"]
    assert all(j.total_gpus <= 8 for j in small) and any(0 < j.gpu_milli < 1000 for j in small)
    with pytest.raises(ValueError, match="Accepted forms"):
        load_trace("mix:teams=99", data)
    # Replayed with equal quotas: per-tenant results with fairness against the quotas.
    m = simulate(jobs, ClusterSpec.parse("32x8,leaf=8"), "topo-mig", quotas=equal_quotas(jobs, 256)).metrics
    assert m["completed"] == len(jobs) and 0 < m["fairness_jain"] <= 1
    assert set(m["tenants"]) == {j.tenant for j in jobs}
    for t in m["tenants"].values():
        assert t["quota_share"] == pytest.approx(1 / 3) and t["gpu_hours_entitled"] > 0 and t["fair_ratio"] > 0
    assert sum(t["received_share"] for t in m["tenants"].values()) == pytest.approx(1.0)


def test_a_head_on_borrowed_quota_preempts_only_its_own_queue_unless_borrowers_may_preempt():
    from phalanx.sim.engine import equal_quotas

    # Three queues of 8 GPUs on three nodes. C runs two 8-GPU gangs (one on quota borrowed from the idle A and B);
    # at 1,000 A submits a 16-GPU gang of high priority: admitted only by borrowing. As the cycle does (default,
    # Kueue's borrowWithinCohort: Never) it may preempt only in its own queue, so it waits for C's gangs (5,000).
    # With borrower_preempts it preempts one of C's gangs (handover at 1,060, done at 3,060; the victim resumes
    # and ends at 7,060).
    jobs = [
        P("c0", 0, 1, 8, 5000, tenant="C"),
        P("c1", 0, 1, 8, 5000, tenant="C"),
        P("b", 0, 1, 1, 1, tenant="B"),
        P("a0", 1000, 2, 8, 2000, priority=10, tenant="A"),
    ]
    cluster, quotas = ClusterSpec.parse("3x8"), equal_quotas(jobs, 24)
    loose = simulate(jobs, cluster, "topo-preempt", quotas=quotas, checkpoint_cost_s=60, borrower_preempts=True)
    assert loose.jct == pytest.approx([1.0, 2060.0, 5000.0, 7060.0]) and loose.metrics["preemptions"] == 1
    kueue = simulate(jobs, cluster, "topo-preempt", quotas=quotas, checkpoint_cost_s=60)
    assert kueue.jct == pytest.approx([1.0, 5000.0, 5000.0, 6000.0]) and kueue.metrics["preemptions"] == 0


def test_a_preemption_whose_preemptor_found_room_elsewhere_is_called_off_as_in_the_cycle():
    # Two nodes. "lo" (priority -1) runs on one, "x" (priority 0, ends at 1,030) on the other. "hi" (priority 10)
    # arrives at 1,000 and asks "lo" to checkpoint (grace 60 s). At 1,030 "x" ends and "hi" starts there; at the
    # grace's end the decision calls the preemption off (phalanx.core.decide `CallOff`, the cycle's rule): "lo" goes
    # on with its GPUs, having lost only the 60 s it stood still, and is never torn down.
    jobs = [P("lo", 0, 1, 8, 3000, priority=-1), P("x", 0, 1, 8, 1030), P("hi", 1000, 1, 8, 1000, priority=10)]
    result = simulate(jobs, ClusterSpec.parse("2x8"), "topo-preempt", checkpoint_cost_s=60)
    assert result.metrics["preemptions"] == 0
    assert result.jct == pytest.approx([1030.0, 1030.0, 3060.0])  # x, hi (starts at 1,030), lo (3,000 + 60)
