"""`phalanx sim run` end to end on a slice of a real trace (skipped, with the reason, without the data folder)."""

from __future__ import annotations

import json

import pytest

from phalanx.cli.main import main
from phalanx.sim.traces import DataNotFound, find_data, philly_teams


@pytest.fixture
def data():
    try:
        return find_data()
    except DataNotFound as exc:
        pytest.skip(f"trace data folder not found: {exc}")


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
