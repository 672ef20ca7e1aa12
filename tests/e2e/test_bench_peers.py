"""bench/peers.py runs Phalanx's side end to end at its smallest (a real scheduler process on PostgreSQL with
lightweight agents), says it skipped Ray and Slurm, and ends with one JSON line; it needs no Ray or Slurm installed.
Its Slurm side runs for real only where asked (PHALANX_BENCH_SLURM=1, as root, with Debian's slurm-wlm): it starts
Slurm daemons on this host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers.bench import bench_server, run_bench

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peers

pytestmark = pytest.mark.postgres


def test_no_ray_quick_run_prints_phalanx_figures_and_says_ray_was_skipped(pg_url):
    out, proc = run_bench(
        "peers.py",
        "--no-ray",
        "--no-slurm",
        "--quick",
        "--samples",
        "3",
        "--db",
        bench_server(pg_url),
        timeout=120,
    )
    assert "skipped Ray: --no-ray" in proc.stderr
    assert out["bench"] == "peers"
    assert out["nodes"] == 4 and out["gpus_per_node"] == 8 and out["samples"] == 3
    phalanx = out["phalanx"]
    for key in ("g1_p50_ms", "g1_p99_ms", "g1_reply_p50_ms", "g1_event_p50_ms", "g4x8_p50_ms", "gangs_per_s"):
        assert phalanx[key] > 0, key
    assert phalanx["g1_p50_ms"] <= phalanx["g1_p99_ms"]
    assert phalanx["gangs_per_round"] == 17  # gang_reservation's mix on 4 x 8 GPUs: one 8-GPU and sixteen 1-GPU
    baseline = out["phalanx_pass"]  # the same figures with every submit decided by a pass
    assert baseline["scheduler_args"] == ["--no-admission-lane"] and phalanx["scheduler_args"] == []
    assert baseline["g1_p50_ms"] > 0 and baseline["gangs_per_s"] > 0
    assert "lane / pass:" in proc.stdout
    locked = out["phalanx_locked"]  # every cycle waiting for the clock row's lock first
    assert locked["scheduler_args"] == ["--no-fence-in-pipeline"] and locked["g4x8_p50_ms"] > 0
    assert "fence in the pipeline / lock first:" in proc.stdout
    assert out["ray"] == {"skipped": "--no-ray"}
    assert out["slurm"] == {"skipped": "--no-slurm"}
    assert "Slurm skipped: --no-slurm" in proc.stdout
    assert out["ratios"] == {} and out["targets_missed"] == []  # nothing to compare with
    assert "phalanx_256" not in out  # --quick


def test_the_ratios_name_each_missed_target():
    phalanx = {"g1_p50_ms": 2.0, "g4x8_p50_ms": 3.0, "gangs_per_s": 1000.0}
    ray = {"g1_p50_ms": 2.5, "g4x8_p50_ms": 4.0, "g4x8_spread_p50_ms": 4.0, "gangs_per_s": 500.0}
    ratios, missed = peers.compare(phalanx, ray)
    assert ratios == {"g1_p50": 0.8, "g4x8_p50": 0.75, "g4x8_spread_p50": 0.75, "gangs_per_s": 2.0}
    assert missed == []
    ratios, missed = peers.compare(phalanx | {"g1_p50_ms": 2.1, "gangs_per_s": 900.0}, ray)
    assert [m.split(":")[0] for m in missed] == ["1-GPU gang p50", "gangs reserved per second, 8 clients"]
    assert peers.compare(phalanx, {"skipped": "--no-ray"}) == ({}, [])

    assert peers.compare(phalanx, ray, {"skipped": "--no-slurm"}) == peers.compare(phalanx, ray)


def test_the_ratios_to_slurm_name_its_missed_target():
    phalanx = {"g1_p50_ms": 2.0, "g4x8_p50_ms": 3.0, "gangs_per_s": 1000.0}
    slurm = {
        "g1_p50_ms": 4.0,
        "g4x8_p50_ms": 6.0,
        "sbatch_per_s": 500.0,
        "sbatch_accepted_per_s": 400.0,
        "salloc_per_s": 250.0,
    }
    ratios, missed = peers.compare(phalanx, {"skipped": "--no-ray"}, slurm)
    assert ratios == {
        "slurm_g1_p50": 0.5,
        "slurm_g4x8_p50": 0.5,
        "slurm_sbatch_per_s": 2.0,
        "slurm_sbatch_accepted_per_s": 2.5,
        "slurm_salloc_per_s": 4.0,
    }
    assert missed == []
    _, missed = peers.compare(phalanx | {"gangs_per_s": 999.0}, {"skipped": "--no-ray"}, slurm)
    assert missed == [
        "gangs reserved per second vs Slurm sbatch jobs allocated per second: Phalanx / Slurm 2.00x, target at least 2.0x"
    ]  # 1.998, printed rounded
    ray = {"g1_p50_ms": 2.5, "g4x8_p50_ms": 4.0, "g4x8_spread_p50_ms": 4.0, "gangs_per_s": 500.0}
    both, _ = peers.compare(phalanx, ray, slurm)
    assert both == peers.compare(phalanx, ray)[0] | ratios


def test_the_slurm_side_says_why_it_skipped():
    assert peers.slurm_side(3, 1, no_slurm=True) == {"skipped": "--no-slurm"}


@pytest.mark.skipif(os.environ.get("PHALANX_BENCH_SLURM") != "1", reason="starts Slurm daemons: PHALANX_BENCH_SLURM=1")
def test_the_slurm_side_measures_salloc_and_sbatch_on_four_slurmd():
    out = peers.slurm_side(3, 1)
    assert "skipped" not in out, out["skipped"]
    assert out["nodes"] == 4 and out["jobs_per_round"] == 17 and out["clients"] == 8
    for key in ("g1_p50_ms", "g1_p99_ms", "g1_exit_p50_ms", "g4x8_p50_ms", "g4x8_p99_ms", "sbatch_per_s"):
        assert out[key] > 0, key
    assert out["g1_p50_ms"] <= out["g1_p99_ms"] and out["g1_p50_ms"] < out["g1_exit_p50_ms"]
    assert out["sbatch_accepted_per_s"] > 0 and out["sbatch_per_s"] > 0
    assert out["salloc_per_s"] > 0
    assert out["sbatch_from_poll"] == 0  # slurmctld's log named every allocation
