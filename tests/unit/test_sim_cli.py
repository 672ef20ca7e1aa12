"""`phalanx sim run` end to end on a slice of a real trace (skipped, with the reason, without the data folder)."""

from __future__ import annotations

import importlib
import json

import pytest

from phalanx.cli.main import main
from phalanx.sim.traces import philly_teams


@pytest.fixture
def data(trace_data):
    return trace_data


@pytest.mark.slow
def test_sim_run_writes_the_report_and_one_json_line(data, tmp_path, capsys):
    team = philly_teams(data)[0]
    out = tmp_path / "report"
    code = main(
        [
            "sim",
            "run",
            "--trace",
            f"philly:team={team}",
            "--limit",
            "300",
            "--cluster",
            "16x8,leaf=4",
            "--policy",
            "pod,gang-fifo,topo",
            "--arrival-scale",
            "0.05",
            "--data",
            str(data),
            "--out",
            str(out),
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"pod", "gang-fifo", "topo"}
    for m in doc["policies"].values():
        assert m["jobs"] == 300 and m["completed"] <= 300
        assert 0 <= m["utilization_allocated"] <= 1
    assert doc["policies"]["topo"]["within_one_leaf"] >= doc["policies"]["gang-fifo"]["within_one_leaf"]
    report = (out / "report.md").read_text()
    assert "| JCT mean (h) |" in report and "hoarded" in report
    assert (out / "result.json").exists() and (out / "utilization.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--policy", "magic"], "unknown magic"),
        (["--cluster", "lots"], "NODESxGPUS"),
        (["--trace", "nonsense:x"], "--trace"),
        (["--failures", "-1"], "--failures"),
    ],
)
def test_sim_run_usage_errors(data, tmp_path, capsys, argv, words):
    base = {"--trace": "philly", "--out": str(tmp_path), "--data": str(data)}
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    args = [x for k, v in {**base, **flags}.items() for x in (k, v)]
    code = main(["sim", "run", *args])
    _, stderr = capsys.readouterr()
    assert code == 2 and words in stderr


def test_sim_run_without_data_says_where_it_looked(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    code = main(["sim", "run", "--trace", "philly", "--out", str(tmp_path / "o")])
    _, stderr = capsys.readouterr()
    assert code == 1 and "PHALANX_DATA" in stderr


@pytest.mark.slow
def test_sim_run_preemption_policies_on_the_multi_tenant_mix_with_quotas(data, tmp_path, capsys):
    out = tmp_path / "mix"
    code = main(
        [
            "sim",
            "run",
            "--trace",
            "mix:teams=3,jobs=60,hours=24,pretrain=3,finetune=150,seed=2",
            "--limit",
            "200",
            "--cluster",
            "32x8,leaf=8",
            "--policy",
            "topo-preempt,topo-mig",
            "--quotas",
            "equal",
            "--data",
            str(data),
            "--out",
            str(out),
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"topo-preempt", "topo-mig"}
    saved = json.loads((out / "result.json").read_text())
    for m in saved.values():
        assert m["jobs"] == 200 and m["completed"] == 200
        assert m["preemptions"] >= m["reclaims"] >= 0 and m["preempt_lost_gpu_hours"] >= 0
        assert 0 < m["fairness_jain"] <= 1
        assert len(m["tenants"]) == 3
        for t in m["tenants"].values():
            assert t["quota_share"] == pytest.approx(1 / 3)
            assert {"gpu_hours_received", "gpu_hours_entitled", "received_share", "fair_ratio", "preempted"} <= set(t)
        assert set(m["priorities"]) <= {"100", "0", "-100"} and "-100" in m["priorities"]
    # Fractional fine-tuning jobs share GPUs under topo-mig only.
    assert saved["topo-mig"]["peak_running_jobs"] >= saved["topo-preempt"]["peak_running_jobs"]
    report = (out / "report.md").read_text()
    assert "## Per tenant" in report and "fairness vs quotas" in report and "preemptions" in report


def _small_csv_run(tmp_path, out):
    """`phalanx sim run` on a 6-job CSV trace (no trace data needed: an empty gavel-philly-derived/ is a data
    folder)."""
    from phalanx.sim.traces import PHILLY_DIR, TraceJob, write_csv

    (tmp_path / "data" / PHILLY_DIR).mkdir(parents=True, exist_ok=True)
    trace = tmp_path / "trace.csv"
    write_csv(
        [
            TraceJob(
                job_id=f"j{i}",
                tenant="t",
                submit_s=60.0 * i,
                replicas=1 + i % 2,
                gpus_per_replica=8,
                gpu_milli=0,
                duration_s=600.0,
            )
            for i in range(6)
        ],
        trace,
    )
    return main(
        [
            "sim",
            "run",
            "--trace",
            f"csv:{trace}",
            "--cluster",
            "4x8,leaf=2",
            "--policy",
            "gang-fifo,topo",
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(out),
        ]
    )


def test_sim_run_draws_the_plots_with_matplotlib(tmp_path, capsys):
    import matplotlib  # noqa: F401  (the test extra brings it, through phalanx[plots])

    out = tmp_path / "o"
    code = _small_csv_run(tmp_path, out)
    _, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "no plots" not in stderr and (out / "utilization.png").stat().st_size > 1000
    assert "![utilization.png](utilization.png)" in (out / "report.md").read_text()


def test_sim_run_without_matplotlib_says_how_to_get_the_plots(tmp_path, capsys, monkeypatch):
    import sys

    # matplotlib unimportable in this process: a None in sys.modules makes `import matplotlib` raise ImportError.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError):
        importlib.import_module("matplotlib")
    out = tmp_path / "o"
    code = _small_csv_run(tmp_path, out)
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "[sim] warning: the report will have no plots: matplotlib is not installed" in stderr
    assert "pip install 'phalanx[plots]'" in stderr and "Traceback" not in stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"gang-fifo", "topo"}
    report = (out / "report.md").read_text()
    assert "| JCT mean (h) |" in report and "No plots: matplotlib is not installed" in report
    assert "pip install 'phalanx[plots]'" in report and not list(out.glob("*.png"))
