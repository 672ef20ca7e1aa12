"""`phalanx sim run` end to end on a slice of a real trace (skipped, with the reason, without the data folder)."""

from __future__ import annotations

import json

import pytest

from phalanx.cli.main import main
from phalanx.sim.traces import philly_teams


@pytest.fixture
def data(trace_data):
    return trace_data


def test_sim_run_writes_the_report_and_one_json_line(data, tmp_path, capsys):
    team = philly_teams(data)[0]
    out = tmp_path / "report"
    code = main(["sim", "run", "--trace", f"philly:team={team}", "--limit", "300", "--cluster", "16x8,leaf=4",
                 "--policy", "pod,gang-fifo,topo", "--arrival-scale", "0.05", "--data", str(data), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"pod", "gang-fifo", "topo"}
    for policy, m in doc["policies"].items():
        assert m["jobs"] == 300 and m["completed"] <= 300
        assert 0 <= m["utilization_allocated"] <= 1
    assert doc["policies"]["topo"]["within_one_leaf"] >= doc["policies"]["gang-fifo"]["within_one_leaf"]
    report = (out / "report.md").read_text()
    assert "| JCT mean (h) |" in report and "hoarded" in report
    assert (out / "result.json").exists() and (out / "utilization.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, words", [
    (["--policy", "magic"], "unknown magic"),
    (["--cluster", "lots"], "NODESxGPUS"),
    (["--trace", "nonsense:x"], "--trace"),
    (["--failures", "-1"], "--failures"),
])
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


def test_sim_run_preemption_policies_on_the_multi_tenant_mix_with_quotas(data, tmp_path, capsys):
    out = tmp_path / "mix"
    code = main(["sim", "run", "--trace", "mix:teams=3,jobs=60,hours=24,pretrain=3,finetune=150,seed=2",
                 "--limit", "200", "--cluster", "32x8,leaf=8", "--policy", "topo-preempt,topo-mig",
                 "--quotas", "equal", "--data", str(data), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"topo-preempt", "topo-mig"}
    saved = json.loads((out / "result.json").read_text())
    for policy, m in saved.items():
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
