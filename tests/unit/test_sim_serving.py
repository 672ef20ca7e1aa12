"""Serving next to training in the replay (phalanx/sim/serving.py): an autoscaled fleet of multi-node replicas placed
and preempted by `decide` beside a training trace, under the static split, plain preemption, and preemption with the
checkpoint handshake and batch backfill; and `phalanx sim serving`, which compares them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from phalanx.cli.main import main
from phalanx.sim import serving
from phalanx.sim.cluster import ClusterSpec
from phalanx.sim.serving import (
    PREEMPT,
    PREEMPT_CHECKPOINT_BACKFILL,
    SERVE_POOL,
    SERVING_POLICIES,
    STATIC_SPLIT,
    ServingSetup,
    ServingSpec,
    simulate_serving,
)
from phalanx.sim.serving_eval import ServingEval, prepare, run_eval
from phalanx.sim.serving_load import DiurnalLoad, LoadSeries, replicas_for
from phalanx.sim.trace_records import TraceJob

# 16 nodes, two days of a load that swings 4:1 and wants half the nodes at its peak, and a synthetic training
# trace that offers what serving leaves on average: the cluster is full.
SMALL = ServingEval(nodes=16, hours=48, peak_to_trough=4.0, serving_share=0.5, trace="synthetic", seed=1)


@pytest.fixture(scope="module")
def small():
    doc, results, prepared = run_eval(SMALL)
    return doc["policies"], {r.policy: r for r in results}, prepared


def test_the_three_policies_run_on_a_small_cluster(small):
    metrics, results, prepared = small
    assert list(metrics) == list(SERVING_POLICIES)
    for policy, m in metrics.items():
        assert len(results[policy].series) == 48 * 60  # one autoscaler step per minute
        assert m["serving"]["replica_hours"] > 0 and m["training"]["started"] > 0
        assert 0 < m["utilization"] <= 1
        assert len(m["serving"]["ready_at_peaks"]) == 2  # 14:00 on each day
    # Training fills the cluster: what serving leaves is busy under the shared policies.
    assert metrics[PREEMPT]["utilization"] > 0.9 and metrics[PREEMPT_CHECKPOINT_BACKFILL]["utilization"] > 0.85
    # The fleet follows the load: at the busiest bin the autoscaler wanted what that load needs.
    most = replicas_for(float(prepared.setup.load.rates.max()), ServingSpec().target_rps)
    assert all(m["serving"]["most_replicas"] == most for m in metrics.values())


def test_serving_with_preemption_is_as_ready_at_every_peak_as_the_static_split(small):
    metrics, _, _ = small
    static = metrics[STATIC_SPLIT]["serving"]
    for policy in (PREEMPT, PREEMPT_CHECKPOINT_BACKFILL):
        s = metrics[policy]["serving"]
        assert all(a >= b for a, b in zip(s["ready_at_peaks"], static["ready_at_peaks"], strict=True)), policy
        assert s["slo_time_share"] >= static["slo_time_share"] - 0.01


def test_the_checkpoint_handshake_loses_less_training_work_than_plain_preemption(small):
    metrics, _, _ = small
    blunt, asked = metrics[PREEMPT]["training"], metrics[PREEMPT_CHECKPOINT_BACKFILL]["training"]
    assert blunt["preemptions"] > 0 and blunt["preempt_lost_gpu_hours"] > 0
    assert asked["preempt_lost_gpu_hours"] < blunt["preempt_lost_gpu_hours"]
    assert asked["goodput"] > blunt["goodput"]
    # With the handshake a victim loses only its grace: 60 s on the GPUs it held.
    assert asked["preempt_lost_gpu_hours"] <= asked["preemptions"] * 60 * SMALL.nodes * 8 / 3600


def test_the_static_split_never_preempts_and_keeps_training_off_the_serving_pool(small):
    metrics, results, prepared = small
    training = metrics[STATIC_SPLIT]["training"]
    assert training["preemptions"] == 0 and training["preempt_lost_gpu_hours"] == 0 and training["goodput"] == 1
    train_pool_gpus = (SMALL.nodes - prepared.setup.pool_nodes()) * 8
    assert max(row[5] for row in results[STATIC_SPLIT].series) <= train_pool_gpus
    # The shared policies run training beyond it.
    assert max(row[5] for row in results[PREEMPT].series) > train_pool_gpus


def test_the_backfill_policy_lends_the_serving_pool_to_batch_gangs_only(monkeypatch):
    on_pool: list[tuple[str, float]] = []
    start = serving._ServingReplay.start

    def recording(self, st, placement):
        start(self, st, placement)
        if not isinstance(st.job, serving.ReplicaJob) and any(
            self.cap.nodes[n].gpu_model == SERVE_POOL for n in placement.nodes
        ):
            on_pool.append((st.job.job_id, st.request.time_limit))

    monkeypatch.setattr(serving._ServingReplay, "start", recording)
    prepared = prepare(dataclasses.replace(SMALL, hours=24))
    simulate_serving(prepared.jobs, prepared.setup, PREEMPT_CHECKPOINT_BACKFILL)
    assert on_pool, "no batch gang used the serving pool's idle GPUs"
    assert all(limit <= prepared.setup.batch_limit_s for _, limit in on_pool)


def test_a_seed_fixes_the_run():
    a, b = prepare(SMALL), prepare(SMALL)
    assert a.jobs == b.jobs and np.array_equal(a.setup.load.counts, b.setup.load.counts)
    first = simulate_serving(a.jobs, a.setup, PREEMPT_CHECKPOINT_BACKFILL, seed=1)
    again = simulate_serving(b.jobs, b.setup, PREEMPT_CHECKPOINT_BACKFILL, seed=1)
    assert first.metrics == again.metrics and first.series == again.series
    other = prepare(dataclasses.replace(SMALL, seed=2))
    assert other.jobs != a.jobs and not np.array_equal(other.setup.load.counts, a.setup.load.counts)


def test_the_autoscaler_is_the_cores_rule(monkeypatch, small):
    calls = []
    real = serving.recommend

    def counting(policy, current, values, now, state):
        calls.append((current, len(values)))
        return real(policy, current, values, now, state)

    monkeypatch.setattr(serving, "recommend", counting)
    prepared = small[2]
    again = simulate_serving(prepared.jobs, prepared.setup, STATIC_SPLIT, seed=1)
    assert len(calls) == 48 * 60 - 1  # every step but the first, which places the warm fleet
    assert again.metrics["serving"] == small[0][STATIC_SPLIT]["serving"]


def flat_load(rps: list[tuple[float, int]]) -> LoadSeries:
    """A load of `rps` requests per second for so many minutes each, minute by minute."""
    counts = np.concatenate([np.full(minutes, int(r * 60)) for r, minutes in rps])
    return LoadSeries(DiurnalLoad(mean_rps=1.0), counts)


def one_gpu_job(i: int, submit: float = 0.0, hours: float = 8.0) -> TraceJob:
    return TraceJob(f"t{i}", "training", submit, 1, 8, 0, hours * 3600)


def test_scaling_down_removes_the_newest_replica_first_a_waiting_one(monkeypatch):
    # 8 nodes, a serving pool of 4 (two replicas). The load wants 4 replicas for 30 minutes, then 1: two run and
    # two wait (the pool is full), so the time with enough capacity is short of all; then the two waiting ones are
    # withdrawn and the second running one stopped: the oldest is left.
    kept = []
    replay_cls = serving._ServingReplay

    class Keeping(replay_cls):
        def run(self):
            super().run()
            kept.append([st.job.job_id for st in self.fleet])
            kept.append(self.cap.free_gpus())

    monkeypatch.setattr(serving, "_ServingReplay", Keeping)
    spec = ServingSpec()
    load = flat_load([(4 * spec.target_rps, 30), (0.5 * spec.target_rps, 60)])
    setup = ServingSetup(ClusterSpec(8, 8, per_leaf=4), load, spec, serve_nodes=4)
    result = simulate_serving([], setup, STATIC_SPLIT)
    s = result.metrics["serving"]
    assert s["replicas_made"] == 4 and s["most_replicas"] == 4
    assert s["slo_time_share"] == pytest.approx(60 / 90)  # short for the first 30 minutes (two of four ready)
    assert kept[0] == ["serve-00001"] and kept[1] == 64 - 16
    assert [row[4] for row in result.series][:3] == [2, 2, 2]  # placed: the pool's two


def test_a_replica_its_pool_cannot_hold_spills_over_and_preempts_through_the_handshake():
    # preempt-checkpoint-backfill with a pool of one replica and a load that wants two: the second replica's pool
    # has nothing it could preempt (the first replica holds it), so it goes anywhere and takes a training node.
    spec = ServingSpec(startup_s=0.0)
    load = flat_load([(1.5 * spec.target_rps, 5), (1.9 * spec.target_rps, 55)])
    setup = ServingSetup(ClusterSpec(6, 8, per_leaf=6), load, spec, serve_nodes=2)
    jobs = [one_gpu_job(i) for i in range(4)]  # long (a 16 h limit): on the training pool only
    result = simulate_serving(jobs, setup, PREEMPT_CHECKPOINT_BACKFILL)
    s, t = result.metrics["serving"], result.metrics["training"]
    assert s["spills"] == 1 and s["most_replicas"] == 2
    assert t["preemptions"] == 2 and t["preempt_lost_gpu_hours"] == pytest.approx(2 * 8 * 60 / 3600)
    assert result.series[-1][3] == 2  # both ready


def test_bad_setups_are_refused():
    spec = ServingSpec()
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_serving([], ServingSetup(ClusterSpec(4, 8), flat_load([(1.0, 10)]), spec), "magic")
    with pytest.raises(ValueError, match="must leave training"):
        simulate_serving([], ServingSetup(ClusterSpec(4, 8), flat_load([(1.0, 10)]), spec, serve_nodes=4), PREEMPT)
    with pytest.raises(ValueError, match="serving-share"):
        prepare(dataclasses.replace(SMALL, serving_share=1.5))
    with pytest.raises(ValueError, match="lower --serving-share"):
        prepare(dataclasses.replace(SMALL, nodes=4, serving_share=0.9))


def test_phalanx_sim_serving_writes_the_table_the_json_and_the_plot(tmp_path, capsys):
    import matplotlib  # noqa: F401  (the test extra brings it, through phalanx[plots])

    out = tmp_path / "o"
    argv = ["sim", "serving", "--nodes", "16", "--hours", "24", "--trace", "synthetic", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    stdout, stderr = capsys.readouterr()
    doc = json.loads(stdout)
    assert list(doc["policies"]) == list(SERVING_POLICIES)
    assert doc["settings"]["nodes"] == 16 and doc["load"]["hourly_peak_to_trough"] == pytest.approx(2.0, rel=0.1)
    table = (out / "serving.md").read_text()
    assert "| serving: time with enough ready capacity (SLO proxy) |" in table and "![serving" in table
    assert (out / "serving.png").stat().st_size > 10_000
    assert json.loads((out / "serving.json").read_text())["policies"].keys() == doc["policies"].keys()
    assert "[sim] preempt-checkpoint-backfill: SLO" in stderr
    # Without --json the table is the output.
    assert main([*argv, "--policy", "static-split"]) == 0
    stdout, _ = capsys.readouterr()
    assert stdout.splitlines()[2].startswith("| metric | static-split |")


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--nodes", "2"], "--nodes must be at least 4"),
        (["--policy", "magic"], "unknown magic"),
        (["--serving-share", "0"], "--serving-share must be between 0 and 1"),
        (["--peak-trough", "0.5"], "--peak-trough must be at least 1"),
    ],
)
def test_phalanx_sim_serving_usage_errors(tmp_path, capsys, extra, words):
    assert main(["sim", "serving", "--trace", "synthetic", "--out", str(tmp_path), *extra]) == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_phalanx_sim_serving_without_the_data_says_where_it_looked_and_what_else_to_run(tmp_path, capsys):
    code = main(["sim", "serving", "--trace", "philly", "--data", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert "--trace synthetic" in err and "Traceback" not in err
