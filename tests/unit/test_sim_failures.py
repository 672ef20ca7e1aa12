"""Failure injection (phalanx.sim.failures), the replay with a recovery policy (phalanx.sim.recovery_replay), the
four-policy evaluation (phalanx.sim.failure_eval) and `phalanx sim failures`."""

from __future__ import annotations

import json
import math

import pytest

from phalanx.cli.main import main
from phalanx.core.recovery import POLICIES, RestartCosts
from phalanx.sim.cluster import ClusterSpec
from phalanx.sim.failure_eval import FailureEval, build_workload, markdown, run_eval, write_outputs
from phalanx.sim.failures import (
    LLAMA3_PER_GPU_DAY,
    FailureModel,
    NodeFailures,
    draw_outages,
    parse_failure_rate,
)
from phalanx.sim.recovery_replay import RecoveryConfig, RecoveryReplay, failure_metrics, simulate_failures
from phalanx.sim.trace_records import TraceJob

NODES = [f"n{i:03d}" for i in range(200)]


def test_the_llama3_rate_is_the_published_count():
    assert LLAMA3_PER_GPU_DAY == pytest.approx(419 / (54 * 16384))
    assert LLAMA3_PER_GPU_DAY == pytest.approx(4.74e-4, rel=1e-3)
    assert parse_failure_rate("llama3") == LLAMA3_PER_GPU_DAY
    assert parse_failure_rate("LLAMA3x10") == pytest.approx(10 * LLAMA3_PER_GPU_DAY)
    assert parse_failure_rate("none") == 0.0 and parse_failure_rate("4.7e-4") == 4.7e-4 and parse_failure_rate(0) == 0


@pytest.mark.parametrize("bad", ["-1", "often", "llama3xmany", "nan", "inf", ""])
def test_bad_failure_rates_are_refused_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="llama3"):
        parse_failure_rate(bad)


def test_failures_are_seeded_and_reproducible_per_node():
    model = FailureModel(0.01, 8, 3600.0)
    a = draw_outages(NODES, model, 30 * 86400, seed=7)
    assert a == draw_outages(NODES, model, 30 * 86400, seed=7)
    assert a != draw_outages(NODES, model, 30 * 86400, seed=8)
    # A node's draws do not depend on which other nodes are asked, nor in what order.
    alone = draw_outages(["n005"], model, 30 * 86400, seed=7)
    assert alone == [o for o in a if o.node == "n005"]
    assert draw_outages(list(reversed(NODES)), model, 30 * 86400, seed=7) == a


def test_the_failure_count_matches_the_rate_over_many_draws():
    # 200 nodes x 8 GPUs at 0.01 per GPU-day for 100 days, repairs of 1 h: a node is up ~99.7% of the time, so
    # about 200 x 8 x 0.01 x 100 x 0.997 = 1,595 failures; Poisson, so within 4 sigma (~160).
    model = FailureModel(0.01, 8, 3600.0)
    days = 100
    for seed in range(3):
        outages = draw_outages(NODES, model, days * 86400, seed=seed)
        expected = len(NODES) * 8 * 0.01 * days * (1 - 0.08 / 24)
        assert abs(len(outages) - expected) < 4 * math.sqrt(expected)
        repairs = [o.up_at - o.down_at for o in outages]
        assert sum(repairs) / len(repairs) == pytest.approx(3600, rel=0.1)
        for node in NODES[:20]:  # a node is down for one repair at a time
            mine = [o for o in outages if o.node == node]
            assert all(b.down_at >= a.up_at for a, b in zip(mine, mine[1:], strict=False))


def test_no_failures_at_rate_zero_and_models_are_checked():
    assert draw_outages(NODES, FailureModel(0.0), 1e9) == []
    assert NodeFailures(FailureModel(0.0)).next_failure("n", 5.0) == math.inf
    with pytest.raises(ValueError, match="repair_mean_s"):
        FailureModel(repair_mean_s=0)
    with pytest.raises(ValueError, match="per_gpu_day"):
        FailureModel(per_gpu_day=-1)
    with pytest.raises(ValueError, match="unknown recovery policy"):
        RecoveryConfig("hope")
    with pytest.raises(ValueError, match="elastic_min"):
        RecoveryConfig(elastic_min=0)


# A scenario built for recovery: two 16-node gangs in 8-node domains on a 48-node cluster, a week of work each,
# at 30 times the Llama 3 rate; the background keeps the rest busy, so a requeued gang waits for room.
CLUSTER = ClusterSpec(48, 8, per_leaf=8, leaves_per_spine=8)


def scenario_jobs():
    big = [TraceJob(f"big{i}", "pt", 0.0, 16, 8, 0, 5 * 86400.0, priority=100) for i in range(2)]
    small = [
        TraceJob(f"s{i:04d}", "team", i * 1800.0, 2, 8, 0, 6 * 3600.0) for i in range(5 * 48)
    ]  # 16 GPUs every half hour for 6 h: the 16 free nodes and more
    return big + small


def replay_metrics(replay):
    return replay.result().metrics | failure_metrics(replay)


def run_policy(policy, seed=1):
    model = FailureModel(30 * LLAMA3_PER_GPU_DAY, 8, 4 * 3600.0)
    config = RecoveryConfig(policy, model, RestartCosts(1800, 300, 900), spares_per_domain=1, large_nodes=8)
    replay = RecoveryReplay(scenario_jobs(), CLUSTER, config, seed=seed)
    replay.run()
    return replay


@pytest.mark.slow
def test_spares_and_elastic_beat_requeue_on_ettr_with_the_same_failures():
    replays = {p: run_policy(p) for p in POLICIES}
    # The same failures for every policy, up to the end of the shortest replay.
    end = min(r.now for r in replays.values())
    logs = {tuple(f for f in r.failure_log if f[0] <= end) for r in replays.values()}
    assert len(logs) == 1 and len(logs.pop()) > 5
    results = {p: replay_metrics(r) for p, r in replays.items()}
    for m in results.values():
        assert m["completed"] == m["jobs"] and 0 < m["ettr"] <= 1 and 0 < m["large_goodput"]["ratio"] <= 1
    assert results["requeue"]["requeues"] > 0 and results["requeue"]["spare_gpu_hours"] == 0
    assert results["spares"]["swaps"] > 0 and results["spares"]["spare_gpu_hours"] > 0
    assert results["elastic"]["shrinks"] > 0 and results["elastic"]["spare_gpu_hours"] == 0
    assert results["spares+elastic"]["ettr"] >= results["requeue"]["ettr"]
    assert results["spares"]["ettr"] >= results["requeue"]["ettr"]
    assert results["elastic"]["ettr"] >= results["requeue"]["ettr"]


def test_a_swap_keeps_the_gang_in_its_domains_and_books_the_spare_again():
    # One gang of 6 nodes in 8-node domains, no background; at 100 x the rate, failures hit it.
    jobs = [TraceJob("big", "pt", 0.0, 6, 8, 0, 2 * 86400.0, priority=100)]
    model = FailureModel(100 * LLAMA3_PER_GPU_DAY, 8, 3600.0)
    config = RecoveryConfig("spares", model, spares_per_domain=1, large_nodes=4)
    replay = RecoveryReplay(jobs, ClusterSpec(16, 8, per_leaf=8), config, seed=2)
    domains_seen = []
    original = replay._restart_in_place

    def watch(st, decision):
        before = {replay.domain[n] for n in st.placed.nodes}
        original(st, decision)
        domains_seen.append((before, {replay.domain[n] for n in st.placed.nodes}, len(st.placed.replicas)))

    replay._restart_in_place = watch
    replay.run()
    m = replay.result().metrics
    assert m["completed"] == 1
    assert domains_seen, "the draw should hit the gang"
    for before, after, size in domains_seen:
        assert after == before and size == 6
    assert replay.counts["swap"] == len(domains_seen) and replay.counts["requeue"] == 0
    assert not replay.spare_of  # the spares went with the gang


def test_an_elastic_gang_shrinks_to_at_least_min_and_grows_back():
    jobs = [TraceJob("big", "pt", 0.0, 8, 8, 0, 2 * 86400.0, priority=100)]
    model = FailureModel(100 * LLAMA3_PER_GPU_DAY, 8, 3600.0)
    config = RecoveryConfig("elastic", model, large_nodes=4, elastic_min=0.75)
    replay = RecoveryReplay(jobs, ClusterSpec(16, 8, per_leaf=8), config, seed=2)
    replay.run()
    st = replay.states["big"]
    sizes = [a.gpus / 8 for a in st.attempts]
    assert replay.counts["shrink"] > 0 and replay.counts["grow"] > 0
    assert min(sizes) >= 6 and max(sizes) == 8 and st.finish is not None


def test_the_workload_is_synthetic_without_data_and_the_table_has_four_rows(tmp_path, monkeypatch):
    monkeypatch.delenv("PHALANX_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    ev = FailureEval(
        cluster="48x8,leaf=8,spine=8",
        large=2,
        large_nodes=16,
        large_days=2,
        background="synthetic",
        load=0.5,
        failures_per_gpu_day=30 * LLAMA3_PER_GPU_DAY,
    )
    assert ev.problems() == []
    jobs, source = build_workload(ev)
    assert "synthetic" in source and sum(j.job_id.startswith("pretrain") for j in jobs) == 2
    doc = run_eval(ev)
    assert [r["policy"] for r in doc["rows"]] == list(POLICIES)
    table = markdown(doc)
    assert table.count("\n") == 5 and "| spares+elastic |" in table
    written = write_outputs(doc, tmp_path / "out")
    assert "failures.json" in written and "failures.md" in written
    assert "Llama 3" in (tmp_path / "out" / "failures.md").read_text()


def test_the_workload_from_the_philly_trace(trace_data):
    ev = FailureEval(cluster="48x8,leaf=8", large=1, large_nodes=16, large_days=1, background="philly")
    jobs, source = build_workload(FailureEval(**{**ev.__dict__, "data": str(trace_data)}))
    assert "Philly" in source and len(jobs) > 1


def test_eval_problems_are_reported():
    bad = FailureEval(cluster="lots", policies=("magic",), background="x", elastic_min=2, repair_hours=0)
    problems = "; ".join(bad.problems())
    for words in ("NODESxGPUS", "unknown magic", "--background", "--elastic-min", "--repair-hours"):
        assert words in problems


def test_sim_failures_cli_prints_the_table_and_writes_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    args = ["sim", "failures", "--cluster", "32x8,leaf=8", "--large", "1", "--large-nodes", "12", "--large-days"]
    args += ["1", "--background", "synthetic", "--load", "0.5", "--failures", "llama3x30", "--out", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["policy"] for r in doc["rows"]] == list(POLICIES)
    assert doc["failures_per_gpu_day"] == pytest.approx(30 * LLAMA3_PER_GPU_DAY)
    assert (tmp_path / "failures.json").exists() and (tmp_path / "failures.md").exists()
    assert main([*args, "--policy", "requeue,spares"]) == 0
    out = capsys.readouterr().out
    assert "| requeue |" in out and "| spares |" in out and "| elastic |" not in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--failures", "often"], "--failures"),
        (["--policy", "magic"], "unknown magic"),
        (["--elastic-min", "0"], "--elastic-min"),
        (["--checkpoint-interval", "0"], "checkpoint_interval_s"),
        (["--cluster", "lots"], "NODESxGPUS"),
    ],
)
def test_sim_failures_usage_errors(tmp_path, capsys, argv, words):
    code = main(["sim", "failures", "--out", str(tmp_path), *argv])
    assert code == 2 and words in capsys.readouterr().err


def test_sim_run_takes_llama3_and_a_repair_time(tmp_path, capsys, trace_data):
    code = main(
        ["sim", "run", "--trace", "philly", "--limit", "50", "--cluster", "16x8,leaf=4", "--policy", "topo"]
        + ["--failures", "llama3x100", "--repair-hours", "2", "--data", str(trace_data), "--out", str(tmp_path)]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["policies"]["topo"]["completed"] == 50


def test_without_failures_every_policy_runs_at_full_ettr_and_only_spares_cost_gpu_hours():
    jobs = [TraceJob("big", "pt", 0.0, 8, 8, 0, 86400.0, priority=100)]
    for policy in POLICIES:
        config = RecoveryConfig(policy, FailureModel(0.0, 8), large_nodes=4)
        m = simulate_failures(jobs, ClusterSpec(16, 8, per_leaf=8), config).metrics
        assert m["ettr"] == pytest.approx(1.0) and m["node_failures"] == 0 and m["completed"] == 1
        assert (m["spare_gpu_hours"] > 0) == ("spares" in policy)
