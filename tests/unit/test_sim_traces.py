"""Trace loaders (phalanx.sim.traces) against the real public data in ../shared/data."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from helpers.required import needs

from phalanx.sim import traces as T

REPO = Path(__file__).resolve().parents[2]


def _locate() -> Path | None:
    for cand in (os.environ.get(T.ENV_VAR), REPO / ".." / "shared" / "data"):
        if cand and T._has_traces(Path(cand)):
            return Path(cand).resolve()
    return None


DATA = _locate()
needs_data = needs(
    "data",
    None
    if DATA is not None
    else f"trace data folder not found (set {T.ENV_VAR} or provide ../shared/data next to the repo)",
)


# --------------------------------------------------------------------------------------------- no data needed


def test_gang_shape_rule():
    assert T.gang_shape(1) == (1, 1)
    assert T.gang_shape(4) == (1, 4)
    assert T.gang_shape(8) == (1, 8)
    assert T.gang_shape(16) == (2, 8)
    assert T.gang_shape(32) == (4, 8)
    assert T.gang_shape(64) == (8, 8)
    assert T.gang_shape(12) == (2, 6)
    assert T.gang_shape(20) == (4, 5)
    assert T.gang_shape(24) == (3, 8)
    assert T.gang_shape(6, per_node=4) == (2, 3)
    for n in range(1, 200):
        r, g = T.gang_shape(n)
        assert r * g == n and 1 <= g <= 8
    with pytest.raises(ValueError):
        T.gang_shape(0)


def _fake_root(tmp_path: Path, name: str = "d") -> Path:
    root = tmp_path / name
    (root / T.POLLUX_DIR / "simulator-workloads").mkdir(parents=True)
    (root / T.POLLUX_DIR / "simulator-workloads" / "workload-1.csv").write_text(
        "name,time,application,num_replicas,batch_size\n"
        "a-0,5,cifar10,2,256\n"
        "bad-1,x,cifar10,2,256\n"
        "b-2,1,imagenet,16,800\n"
        "c-3,3,nosuchapp,1,1\n"
    )
    return root


def test_find_data_order(tmp_path, monkeypatch):
    explicit = _fake_root(tmp_path, "explicit")
    env = _fake_root(tmp_path, "env")
    work = tmp_path / "proj" / "main"
    work.mkdir(parents=True)
    cwd_data = tmp_path / "proj" / "shared" / "data"
    (cwd_data / T.ALIBABA_DIR).mkdir(parents=True)

    monkeypatch.setenv(T.ENV_VAR, str(env))
    assert T.find_data(str(explicit), cwd=work) == explicit.resolve()  # --data first
    assert T.find_data(None, cwd=work) == env.resolve()  # then PHALANX_DATA
    monkeypatch.delenv(T.ENV_VAR)
    assert T.find_data(None, cwd=work) == cwd_data.resolve()  # then ../shared/data
    monkeypatch.chdir(work)
    assert T.find_data() == cwd_data.resolve()


def test_find_data_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(T.ENV_VAR, raising=False)
    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(T.DataNotFound) as e:
        T.find_data(None, cwd=work)
    msg = str(e.value)
    assert "--data" in msg and T.ENV_VAR in msg and "shared/data" in msg
    assert T.PHILLY_DIR in msg and T.ALIBABA_DIR in msg and T.POLLUX_DIR in msg
    assert "Pass --data DIR" in msg
    # A wrong explicit choice is an error, not silently skipped.
    with pytest.raises(T.DataNotFound, match="--data"):
        T.find_data(str(tmp_path / "missing"), cwd=work)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(T.ENV_VAR, str(empty))
    with pytest.raises(T.DataNotFound, match=T.ENV_VAR):
        T.find_data(None, cwd=work)
    assert issubclass(T.DataNotFound, FileNotFoundError)


def test_malformed_rows_skipped_and_counted(tmp_path):
    root = _fake_root(tmp_path)
    t = T.load_pollux(root)
    assert [j.job_id for j in t] == ["b-2", "a-0"]  # sorted by submit time
    assert t.skipped == 2
    b = t[0]
    assert (b.replicas, b.gpus_per_replica) == (2, 8)
    assert T.load_pollux(root, gpus_per_node=4)[0].replicas == 4


def test_csv_roundtrip_and_spec(tmp_path):
    jobs = [
        T.TraceJob("j1", "t", 10.0, 2, 8, 0, 100.0, gpu_models=("A100", "H100"), model="m"),
        T.TraceJob("j0", "", 0.0, 1, 1, 250, 5.0, cpu_milli=1000, memory_mib=2048, duration_estimated=True),
    ]
    p = tmp_path / "t.csv"
    T.write_csv(jobs, p)
    back = T.load_trace(str(p))
    assert [j.job_id for j in back] == ["j0", "j1"]
    assert back[1].gpu_models == ("A100", "H100") and back[1].total_gpus == 16
    assert back[0].gpu_milli == 250 and back[0].duration_estimated and back[0].gpu_demand_milli == 250
    assert [j.job_id for j in T.load_trace(f"csv:{p}")] == ["j0", "j1"]
    with open(p, "a") as fh:
        fh.write("bad,,0,1,9,0,10,0,0,,,0,0,0,,,0,\n")  # 9 GPUs per replica
    assert T.load_csv(p).skipped == 1


def test_tracejob_is_frozen():
    j = T.TraceJob("a", "", 0.0, 1, 1, 0, 1.0)
    with pytest.raises(AttributeError):
        j.replicas = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "nosuch",
        "nosuch:x",
        "philly:limit=x",
        "philly:colour=red",
        "alibaba:a,b",
        "pollux:workload-1,variant=weird",
        "philly:,",
    ],
)
def test_bad_spec(spec, tmp_path):
    with pytest.raises(ValueError) as e:
        T.load_trace(spec, _fake_root(tmp_path))
    assert "Accepted forms" in str(e.value) and "philly:team=" in str(e.value)


# --------------------------------------------------------------------------------------------- real data


@needs_data
def test_philly_counts_and_fields():
    t = T.load_philly(DATA)
    assert len(t) == 15_264 and t.skipped == 0  # README: 15 VCs, 15,264 jobs
    assert len(T.philly_teams(DATA)) == 15
    assert len({j.tenant for j in t}) == 15
    assert len({j.job_id for j in t}) == len(t)
    for j in t:
        assert j.duration_s > 0 and j.total_steps > 0 and j.submit_s >= 0
        assert 1 <= j.gpus_per_replica <= 8 and j.replicas >= 1 and j.gpu_milli == 0
        assert j.model and j.source == "philly"
    assert [j.submit_s for j in t] == sorted(j.submit_s for j in t)
    shapes = Counter(j.total_gpus for j in t)
    assert shapes[1] == 10_480 and shapes[16] == 255 and shapes[64] == 1
    assert Counter((j.replicas, j.gpus_per_replica) for j in t)[(2, 8)] == 255
    # Calibrated durations follow the real Philly runtime distribution (median 1186 s).
    durs = sorted(j.duration_s for j in t)
    assert 600 < durs[len(durs) // 2] < 2500
    resnet = [j for j in t if j.model.startswith("ResNet-50 (batch size 64)")]
    assert resnet and all(j.batch_size == 64 for j in resnet)


@needs_data
def test_philly_duration_rank_preserved_and_exact_override():
    t = T.load_philly(DATA, teams=["6214e9"])
    grp = sorted(
        (j for j in t if j.model == "ResNet-18 (batch size 32)" and j.total_gpus == 1), key=lambda j: j.total_steps
    )
    assert len(grp) > 10
    assert [j.duration_s for j in grp] == sorted(j.duration_s for j in grp)
    exact = T.load_philly(DATA, teams="6214e9", steps_per_s={"ResNet-18 (batch size 32)": 10.0})
    e = [j for j in exact if j.model == "ResNet-18 (batch size 32)"]
    assert all(j.duration_s == j.total_steps / 10.0 and not j.duration_estimated for j in e)


@needs_data
def test_philly_team_filter_and_limit():
    t = T.load_philly(DATA, teams=["6214e9"], limit=50)
    assert len(t) == 50 and {j.tenant for j in t} == {"6214e9"}
    with pytest.raises(ValueError, match="unknown Philly team"):
        T.load_philly(DATA, teams=["nope"])


@needs_data
def test_alibaba_default_counts_and_fields():
    t = T.load_alibaba_v2023(DATA)
    assert len(t) == 8_152 and t.skipped == 0
    kinds = Counter()
    for j in t:
        assert j.duration_s > 0 and j.submit_s >= 0 and j.cpu_milli >= 0 and j.memory_mib >= 0
        assert j.replicas == 1 and 0 <= j.gpus_per_replica <= 8
        if j.is_fractional:
            assert 1 <= j.gpu_milli <= 999 and j.gpus_per_replica == 1
            kinds["frac"] += 1
        elif j.gpus_per_replica == 0:
            kinds["cpu"] += 1
        else:
            kinds[j.gpus_per_replica] += 1
    # README: 1088 CPU-only, 6989 one-GPU (3078 fractional), 16 two-GPU, 15 four-GPU, 44 eight-GPU
    assert kinds == Counter({"cpu": 1088, 1: 6989 - 3078, "frac": 3078, 2: 16, 4: 15, 8: 44})
    frac = sorted(j.gpu_milli for j in t if j.is_fractional)
    assert frac[len(frac) // 2] == 470  # README: median gpu_milli 470
    assert Counter(j.qos for j in t) == Counter({"LS": 4647, "BE": 3398, "Burstable": 100, "Guaranteed": 7})
    span = max(j.submit_s for j in t) - min(j.submit_s for j in t)
    assert 12.5e6 < span < 13.2e6  # ~12.9 M s
    assert sum(j.duration_estimated for j in t) == Counter(j.status for j in t)["Pending"]


@needs_data
def test_alibaba_variants():
    assert {"default", "gpushare40", "gpuspec33", "multigpu50", "cpu250"} <= set(T.alibaba_task_lists(DATA))
    gs = T.load_alibaba_v2023(DATA, "gpushare40")
    assert len(gs) == 8_152 and sum(j.is_fractional for j in gs) == 4_001
    spec = T.load_alibaba_v2023(DATA, "gpuspec33")
    assert sum(bool(j.gpu_models) for j in spec) == 2_388
    mg = T.load_alibaba_v2023(DATA, "multigpu20")  # no time columns
    assert len(mg) == 8_324 and all(j.duration_s > 0 for j in mg)
    with pytest.raises(ValueError, match="unknown Alibaba task list"):
        T.load_alibaba_v2023(DATA, "nope")


@needs_data
def test_alibaba_nodes():
    nodes = T.load_alibaba_nodes(DATA)
    assert len(nodes) == 1_213 and sum(n.gpus for n in nodes) == 6_212
    by = Counter()
    for n in nodes:
        by[n.model] += n.gpus
    assert by["G2"] == 4_392 and by["T4"] == 842 and by["A10"] == 2
    allnodes = T.load_alibaba_nodes(DATA, all_nodes=True)
    assert len(allnodes) == 1_523 and sum(1 for n in allnodes if n.gpus == 0) == 310


@needs_data
@pytest.mark.parametrize("variant", ["simulator", "testbed", "realistic"])
def test_pollux(variant):
    for k in range(1, 9):
        t = T.load_pollux(DATA, f"workload-{k}", variant=variant)
        assert len(t) == 160 and t.skipped == 0
        for j in t:
            assert j.duration_s > 0 and 1 <= j.gpus_per_replica <= 8 and j.batch_size > 0
            assert j.model in {"cifar10", "ncf", "deepspeech2", "yolov3", "bert", "imagenet"}
    with pytest.raises(ValueError, match="unknown Pollux workload"):
        T.load_pollux(DATA, "workload-99")


@needs_data
def test_load_trace_specs():
    assert len(T.load_trace("philly", DATA)) == 15_264
    one = T.load_trace("philly:team=6214e9", DATA)
    assert {j.tenant for j in one} == {"6214e9"} and len(one) == 2_000
    two = T.load_trace("philly:6214e9,ee9e8c,limit=10", DATA)
    assert Counter(j.tenant for j in two) == Counter({"6214e9": 10, "ee9e8c": 10})
    assert len(T.load_trace("alibaba", DATA)) == 8_152
    assert len(T.load_trace("alibaba:default", DATA)) == 8_152
    assert len(T.load_trace("alibaba:multigpu30", DATA)) == 8_508
    p3 = T.load_trace("pollux:workload-3", DATA)
    assert len(p3) == 160 and p3[0].source == "pollux:workload-3:simulator"
    assert T.load_trace("pollux:3", DATA)[0] == p3[0]
    real = T.load_trace("pollux:workload-6,variant=realistic", DATA)
    assert real[0].source.endswith(":realistic")
    for spec in ("philly:team=6214e9", "alibaba", "pollux:workload-2"):
        jobs = T.load_trace(spec, DATA)
        assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    with pytest.raises(ValueError, match="Accepted forms"):
        T.load_trace("philly:team=nope", DATA)
    with pytest.raises(ValueError, match="Accepted forms"):
        T.load_trace("alibaba:nope", DATA)


@needs_data
def test_load_trace_uses_env(monkeypatch):
    monkeypatch.setenv(T.ENV_VAR, str(DATA))
    assert len(T.load_trace("pollux")) == 160
