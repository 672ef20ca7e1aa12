"""The `phalanx` CLI end to end, via main([...]) against a real gRPC fake scheduler: JSON on stdout and nothing
else, exit codes, stderr error lines, `--` command handling, reserved flags, and `phalanx db upgrade`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.api.v1 import common_pb2
from phalanx.cli.main import GPU_SUBMIT_FLAGS, RESERVED_SUBMIT_FLAGS, TIER_SUBMIT_FLAGS, main
from phalanx.core.fabric import default_fabric
from phalanx.core.preemption import PreemptionPolicy
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(30)

# The fake scheduler lives in test_client.py; load it by path so this works under any pytest import mode.
_spec = importlib.util.spec_from_file_location("_phalanx_fake_scheduler", Path(__file__).with_name("test_client.py"))
_fake_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fake_mod)
serve_fake = _fake_mod.serve_fake
closed_port_address = _fake_mod.closed_port_address
JOB_KEYS = _fake_mod.JOB_KEYS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    with serve_fake() as pair:
        yield pair


def run(capsys, *argv):
    """main(argv) -> (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli(capsys, address, *argv):
    return run(capsys, "--scheduler", address, "--timeout", "5", *argv)


# -- submit --------------------------------------------------------------------------------------------------------


def test_submit_json_prints_only_the_job_object(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "train",
        "--replicas",
        "2",
        "--gpus-per-replica",
        "4",
        "--priority",
        "7",
        "--procs-per-replica",
        "1",
        "--env",
        "A=1",
        "B=x=y",
        "--env",
        "C=",
        "--json",
        "--",
        "torchrun",
        "--nproc",
        "4",
        "train.py",
        "--",
        "--lr",
        "3e-4",
    )
    assert code == 0, err
    assert err == ""
    job = json.loads(out)  # the whole of stdout is one JSON document
    assert JOB_KEYS <= set(job)
    assert job["name"] == "train" and job["state"] == "PENDING" and isinstance(job["id"], str)
    assert (job["replicas"], job["gpus_per_replica"], job["priority"], job["procs_per_replica"]) == (2, 4, 7, 1)
    assert job["command"] == ["torchrun", "--nproc", "4", "train.py", "--", "--lr", "3e-4"]
    assert job["allocations"] == [] and job["attempt"] == 0 and job["exit_code"] == 0
    spec = servicer.jobs[job["id"]].spec
    assert list(spec.command) == job["command"]
    assert dict(spec.env) == {"A": "1", "B": "x=y", "C": ""}
    assert len(servicer.request_ids[0]) == 32


def test_submit_human_output_and_command_without_dashes(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1", "python", "x.py"
    )
    assert code == 0 and err == ""
    (job_id,) = servicer.jobs
    assert "id:" in out and job_id in out and "PENDING" in out and "python x.py" in out
    assert list(servicer.jobs[job_id].spec.command) == ["python", "x.py"]


def test_submit_without_a_command_is_a_usage_error(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1", "--")
    assert code == 2 and out == "" and err.startswith("error: a command is required")
    assert servicer.calls == {}


@pytest.mark.parametrize("flag", RESERVED_SUBMIT_FLAGS)
@pytest.mark.parametrize("with_value", [True, False])
def test_reserved_submit_flags_are_rejected(fake, capsys, flag, with_value):
    servicer, address = fake
    extra = [flag, "x"] if with_value else [flag]
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        *extra,
        "--json",
        "--",
        "true",
    )
    assert code == 2 and out == ""
    assert err == f"error: {flag} is not supported yet\n"
    assert servicer.calls == {}


def test_reserved_flag_names_are_exactly_the_contract():
    # The tier and GPU flags were reserved names and are now supported under exactly those names; the rest stay
    # refused.
    assert set(TIER_SUBMIT_FLAGS) == {"--required-tier", "--preferred-tier"}
    assert set(GPU_SUBMIT_FLAGS) == {"--mig", "--gpu-milli", "--gpu-model"}
    assert set(RESERVED_SUBMIT_FLAGS) == set()


def test_submit_gpu_flags_reach_the_scheduler_and_the_json(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "2",
        "--mig",
        "3g.40gb",
        "--gpu-model",
        "H100",
        "--json",
        "--",
        "true",
    )
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.mig_profile, spec.gpu_model, spec.gpu_milli, spec.gpus_per_replica) == ("3g.40gb", "H100", 0, 1)
    assert (job["mig_profile"], job["gpu_model"], job["gpu_milli"]) == ("3g.40gb", "H100", 0)
    code, out, err = cli(
        capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpu-milli", "250", "--json", "--", "true"
    )
    assert code == 0, err
    spec = servicer.jobs[json.loads(out)["id"]].spec
    assert (spec.gpu_milli, spec.mig_profile, spec.gpus_per_replica) == (250, "", 1)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90),
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1d", 86400),
        ("1:30", 90),
        ("1:30:00", 5400),
        ("2-00:00:00", 172800),
        ("0.5h", 1800),
    ],
)
def test_time_limit_durations(text, seconds):
    from phalanx.cli.main import parse_duration

    assert parse_duration(text) == seconds


def test_time_limit_reaches_the_scheduler_and_bad_ones_are_usage_errors(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "8",
        "--time-limit",
        "1:30:00",
        "--json",
        "--",
        "true",
    )
    assert code == 0, err
    job = json.loads(out)
    assert servicer.jobs[job["id"]].spec.time_limit_s == 5400 and job["time_limit"] == 5400
    for bad in ("soon", "0", "-5m", "1:2:3:4", "x-1:00"):
        code, out, err = cli(
            capsys,
            address,
            "submit",
            "--name",
            "t",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--time-limit",
            bad,
            "--",
            "true",
        )
        assert code == 2 and out == "", (bad, err)
        assert bad == "-5m" or "is not a duration" in err or "more than 0" in err, (bad, err)


def test_submit_max_restarts_reaches_the_scheduler_and_the_json(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "2",
        "--gpus-per-replica",
        "8",
        "--max-restarts",
        "3",
        "--json",
        "--",
        "true",
    )
    assert code == 0, err
    job = json.loads(out)
    assert servicer.jobs[job["id"]].spec.max_restarts == 3 and job["max_restarts"] == 3
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "8",
        "--max-restarts",
        "x",
        "--",
        "true",
    )
    assert code == 2 and out == ""


def test_gpus_per_replica_is_required_for_whole_gpus(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--json", "--", "true")
    assert code == 2 and out == "" and "--gpus-per-replica is required" in err
    assert servicer.calls == {}


@pytest.mark.parametrize("flag", ["--mig", "--gpu-milli", "--gpu-model"])
def test_gpu_flag_without_a_value_is_a_usage_error(fake, capsys, flag):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        "--json",
        flag,
        "--",
        "true",
    )
    assert code == 2 and out == "" and flag in err
    assert servicer.calls == {}


def test_submit_tier_flags_reach_the_scheduler_and_the_json(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "2",
        "--gpus-per-replica",
        "8",
        "--required-tier",
        "leaf",
        "--preferred-tier",
        "node",
        "--json",
        "--",
        "true",
    )
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.required_tier, spec.preferred_tier) == ("leaf", "node")
    assert (job["required_tier"], job["preferred_tier"]) == ("leaf", "node")


def test_submit_without_tier_flags_sends_no_constraint(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1", "--json", "--", "true"
    )
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.required_tier, spec.preferred_tier) == ("", "")
    assert (job["required_tier"], job["preferred_tier"]) == ("", "")


@pytest.mark.parametrize("flag", TIER_SUBMIT_FLAGS)
def test_tier_flag_without_a_value_is_a_usage_error(fake, capsys, flag):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        "--json",
        flag,
        "--",
        "true",
    )
    assert code == 2 and out == "" and "error:" in err and flag in err
    assert servicer.calls == {}


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1", "--env", "NOEQUALS", "--", "true"],
        ["submit", "--name", "t", "--replicas", "two", "--gpus-per-replica", "1", "--", "true"],
        ["submit", "--replicas", "1", "--gpus-per-replica", "1", "--", "true"],
        ["jobs", "--state", "DONE"],
        ["frobnicate"],
        [],
    ],
)
def test_usage_errors_exit_2_with_stderr_only(fake, capsys, argv):
    servicer, address = fake
    code, out, err = cli(capsys, address, *argv)
    assert code == 2 and out == "" and "error:" in err
    assert servicer.calls == {}


def test_server_rejection_is_exit_1_with_code_name(fake, capsys):
    _, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "refused-by-server",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        "--json",
        "--",
        "true",
    )
    assert code == 1 and out == ""
    assert err == "error: INVALID_ARGUMENT: refused by the server\n"


@pytest.mark.parametrize(
    "args,words",
    [
        (["--replicas", "0", "--gpus-per-replica", "1"], "--replicas must be at least 1, got 0"),
        (["--replicas", "1", "--gpus-per-replica", "-2"], "--gpus-per-replica must be at least 1, got -2"),
        (["--replicas", "x", "--gpus-per-replica", "1"], "--replicas takes a whole number"),
        (["--replicas", "1", "--gpu-milli", "1000"], "--gpu-milli must be 1 to 999"),
        (["--replicas", "1", "--gpus-per-replica", "1", "--max-restarts", "-1"], "--max-restarts must be at least 0"),
        (["--replicas", "1", "--mig", "1g.10gb", "--gpu-milli", "100"], "--mig or --gpu-milli, not both"),
        (["--replicas", "1", "--gpus-per-replica", "1", "--memory-per-replica", "12X"], "is not a size like 512M"),
        (["--replicas", "1", "--gpus-per-replica", "1", "--cpus-per-replica", "0"], "must be more than 0"),
    ],
)
def test_invalid_arguments_are_exit_2_before_any_call(fake, capsys, args, words):
    servicer, address = fake
    calls = len(servicer.request_ids)
    code, out, err = cli(capsys, address, "submit", "--name", "t", *args, "--", "true")
    assert code == 2 and out == "" and words in err, err
    assert len(servicer.request_ids) == calls  # caught before the call


# -- jobs / job / cancel / nodes --------------------------------------------------------------------------------


def _seed(servicer):
    a = servicer.add_job(
        "alpha",
        2,
        4,
        state=common_pb2.JOB_STATE_SUCCEEDED,
        finished_at=time.time(),
        allocations=[
            common_pb2.Allocation(replica=0, node="gpu-a", gpus=[0, 1, 2, 3]),
            common_pb2.Allocation(replica=1, node="gpu-b", gpus=[0, 1, 2, 3]),
        ],
    )
    b = servicer.add_job(
        "beta",
        1,
        8,
        state=common_pb2.JOB_STATE_RUNNING,
        priority=10,
        allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=list(range(8)))],
    )
    c = servicer.add_job("gamma", 4, 8)
    return a, b, c


def test_jobs_json_is_one_page_object_newest_first_with_finished_jobs(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, err = cli(capsys, address, "jobs", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"jobs", "next_page_token"} and doc["next_page_token"] == ""  # the last (only) page
    jobs = doc["jobs"]
    assert isinstance(jobs, list) and [j["id"] for j in jobs] == [c.id, b.id, a.id]
    assert all(JOB_KEYS <= set(j) for j in jobs)
    assert jobs[2]["state"] == "SUCCEEDED"
    assert jobs[2]["allocations"] == [
        {"replica": 0, "node": "gpu-a", "gpus": [0, 1, 2, 3]},
        {"replica": 1, "node": "gpu-b", "gpus": [0, 1, 2, 3]},
    ]
    assert jobs[1]["priority"] == 10


def test_jobs_state_filter(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, _ = cli(capsys, address, "jobs", "--state", "running", "PENDING", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == [c.id, b.id]
    code, out, _ = cli(capsys, address, "jobs", "--state", "SUCCEEDED", "--state", "FAILED", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == [a.id]
    code, out, _ = cli(capsys, address, "jobs", "--state", "CANCELLED", "--json")
    assert code == 0 and json.loads(out) == {"jobs": [], "next_page_token": ""}


def test_jobs_table_is_aligned(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, err = cli(capsys, address, "jobs")
    assert code == 0 and err == ""
    lines = out.rstrip("\n").splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATE", "PRI", "GANG", "NODES", "AGE", "SERVICE"]
    assert len(lines) == 4
    header = lines[0]
    for column in ("NAME", "STATE", "PRI", "GANG", "NODES", "AGE", "SERVICE"):
        start = header.index(column)
        for row in lines[1:]:
            assert row[start - 2 : start] == "  " and row[start] != " ", (column, row)
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows[a.id][1:6] == ["alpha", "SUCCEEDED", "0", "2x4", "gpu-a,gpu-b"]
    assert rows[b.id][1:6] == ["beta", "RUNNING", "10", "1x8", "gpu-a"]
    assert rows[c.id][1:6] == ["gamma", "PENDING", "0", "4x8", "-"]
    assert {row[-1] for row in rows.values()} == {"-"}  # no job is a service's replica


def test_job_and_cancel(fake, capsys):
    servicer, address = fake
    a, b, _ = _seed(servicer)
    code, out, err = cli(capsys, address, "job", b.id, "--json")
    assert code == 0 and err == "" and json.loads(out)["id"] == b.id
    code, out, err = cli(capsys, address, "job", b.id)
    assert code == 0 and b.id in out and "gpu-a" in out and "RUNNING" in out
    assert "exit code" not in out  # a running job has none yet
    code, out, err = cli(capsys, address, "job", a.id)
    assert code == 0 and "exit code" in out  # the finished one does
    code, out, err = cli(capsys, address, "cancel", b.id, "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["state"] == "CANCELLED"


def test_missing_job_is_exit_1_not_found(fake, capsys):
    _, address = fake
    for argv in (["job", "nope"], ["job", "nope", "--json"], ["cancel", "nope"], ["watch", "nope"]):
        code, out, err = cli(capsys, address, *argv)
        assert code == 1 and out == ""
        assert err == "error: NOT_FOUND: job nope not found\n"


def test_cancel_refused_is_failed_precondition(fake, capsys):
    servicer, address = fake
    a, _, _ = _seed(servicer)
    code, out, err = cli(capsys, address, "cancel", a.id)
    assert code == 1 and out == "" and err == f"error: FAILED_PRECONDITION: job {a.id} already finished\n"


def test_nodes_json_and_table(fake, capsys):
    _, address = fake
    code, out, err = cli(capsys, address, "nodes", "--json")
    assert code == 0 and err == ""
    nodes = json.loads(out)
    assert [(n["name"], n["gpus"], n["free_gpus"], n["state"]) for n in nodes] == [
        ("gpu-a", 8, 6, "READY"),
        ("gpu-b", 8, 8, "DRAINED"),
    ]
    code, out, err = cli(capsys, address, "nodes")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["NAME", "STATE", "GPUS", "FREE"]
    assert lines[1].split()[:4] == ["gpu-a", "READY", "8", "6"] and "leaf0/spine0" in lines[1]
    assert "maintenance" in lines[2]


def test_scheduler_address_from_env(fake, capsys, monkeypatch):
    _, address = fake
    monkeypatch.setenv("PHALANX_SCHEDULER", address)
    code, out, err = run(capsys, "nodes", "--json")
    assert code == 0 and len(json.loads(out)) == 2


def test_unreachable_scheduler(capsys, monkeypatch):
    address = closed_port_address()
    code, out, err = run(capsys, "--scheduler", address, "--timeout", "20", "jobs", "--json")
    assert code == 1 and out == ""
    assert err.startswith(f"error: UNAVAILABLE: cannot reach scheduler at {address}")
    assert err.count("\n") == 1  # one line, no traceback


def test_default_address_when_nothing_is_set(capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    import phalanx.cli.console as cli_console

    seen = {}
    real = cli_console.Client

    def spy(target, **kw):
        c = real(target, **kw)
        seen["target"] = c.target
        return c

    monkeypatch.setattr(cli_console, "Client", spy)
    run(capsys, "--timeout", "1", "nodes")
    assert seen["target"] == "127.0.0.1:50051"


# -- watch -----------------------------------------------------------------------------------------------------


def test_watch_prints_a_line_per_change_until_all_finish(fake, capsys):
    servicer, address = fake
    j1 = servicer.add_job("one")
    j2 = servicer.add_job("two", state=common_pb2.JOB_STATE_RUNNING)
    done = servicer.add_job("done", state=common_pb2.JOB_STATE_SUCCEEDED)

    def drive():  # each change once the watcher has seen the one before (the first two: the live jobs as they are)
        servicer.wait_events(2)
        servicer.update(
            j1.id,
            state=common_pb2.JOB_STATE_RUNNING,
            allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=[0])],
        )
        servicer.wait_events(3)
        servicer.update(j2.id, state=common_pb2.JOB_STATE_FAILED, exit_code=2, message="rank 0 exited 2")
        servicer.wait_events(4)
        servicer.update(j1.id, state=common_pb2.JOB_STATE_SUCCEEDED)

    t = threading.Thread(target=drive)
    t.start()
    code, out, err = cli(capsys, address, "watch", j1.id, j2.id, done.id)
    t.join()
    assert code == 0 and err == ""
    lines = out.splitlines()
    got = [(line.split()[1], line.split()[3]) for line in lines]
    assert got == [
        (j1.id, "PENDING"),
        (j2.id, "RUNNING"),
        (done.id, "SUCCEEDED"),
        (j1.id, "RUNNING"),
        (j2.id, "FAILED"),
        (j1.id, "SUCCEEDED"),
    ]
    assert "rank 0 exited 2" in lines[4] and "exit_code=2" in lines[4] and "nodes=gpu-a" in lines[3]


def test_watch_json_lines(fake, capsys):
    servicer, address = fake
    j = servicer.add_job("one")

    def cancel():  # once the watcher has seen it pending
        servicer.wait_events(1)
        servicer.update(j.id, state=common_pb2.JOB_STATE_CANCELLED)

    t = threading.Thread(target=cancel)
    t.start()
    code, out, err = cli(capsys, address, "watch", "--json", j.id)
    t.join()
    assert code == 0 and err == ""
    states = [json.loads(line)["state"] for line in out.splitlines()]
    assert states == ["PENDING", "CANCELLED"]


# -- db upgrade / misc -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_db_upgrade_on_a_temp_sqlite_file(tmp_path, capsys):
    from db.migrate import current, head_revision

    url = f"sqlite:///{tmp_path / 'sub' / 'phalanx.db'}"
    (tmp_path / "sub").mkdir()
    code, out, err = run(capsys, "db", "upgrade", "--db", url, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown == {"db": url, "revision": head_revision(), "cluster_id": shown["cluster_id"]}
    assert len(shown["cluster_id"]) >= 32  # a UUID, the ledger's identity
    assert current(url) == head_revision()
    code, out, err = run(capsys, "db", "upgrade", "--db", url)  # idempotent, and the identity stays
    assert code == 0 and head_revision() in out and shown["cluster_id"] in out


@pytest.mark.slow
def test_db_upgrade_url_from_env(tmp_path, capsys, monkeypatch):
    from db.migrate import current, head_revision

    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("PHALANX_DB", url)
    code, out, err = run(capsys, "db", "upgrade")
    assert code == 0, err
    assert current(url) == head_revision()


@pytest.mark.slow
def test_db_upgrade_failure_is_one_error_line(tmp_path, capsys):
    code, out, err = run(capsys, "db", "upgrade", "--db", "nosuchdialect://x/y")
    assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "submit" in out and "nodes" in out


@pytest.mark.slow
def test_console_entry_point_in_a_subprocess(fake):
    _, address = fake
    env = {**os.environ, "PHALANX_SCHEDULER": address}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "nodes", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert [n["name"] for n in json.loads(proc.stdout)] == ["gpu-a", "gpu-b"]
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "job", "nope"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=20,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "error: NOT_FOUND: job nope not found\n"


# -- priority classes, checkpoint and goodput (fake scheduler) -------------------------------------------------------


@pytest.mark.parametrize("value,expected", [("high", 100), ("CRITICAL", 200), ("batch", -100), ("-5", -5), ("42", 42)])
def test_submit_priority_takes_an_integer_or_a_class_name(fake, capsys, value, expected):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        "--priority",
        value,
        "--json",
        "--",
        "true",
    )
    assert code == 0, err
    job = json.loads(out)
    assert job["priority"] == expected and servicer.jobs[job["id"]].spec.priority == expected


def test_bad_priority_is_a_usage_error_listing_the_classes(fake, capsys):
    servicer, address = fake
    code, out, err = cli(
        capsys,
        address,
        "submit",
        "--name",
        "t",
        "--replicas",
        "1",
        "--gpus-per-replica",
        "1",
        "--priority",
        "urgent",
        "--json",
        "--",
        "true",
    )
    assert code == 2 and out == "" and "error:" in err and "'urgent'" in err
    for name in ("best-effort", "batch", "default", "high", "critical"):
        assert name in err
    assert servicer.calls == {}


@pytest.mark.parametrize(
    "argv",
    [
        ["goodput", "--since", "yesterday"],
        ["goodput", "--since", "-1"],
        ["goodput", "--limit", "-1"],
        ["goodput", "--limit", "many"],
        ["checkpoint"],
        ["checkpoint", "job-0001", "--reason", ""],
    ],
)
def test_checkpoint_and_goodput_usage_errors(fake, capsys, argv):
    servicer, address = fake
    code, out, err = cli(capsys, address, *argv)
    assert code == 2 and out == "" and "error:" in err
    assert servicer.calls == {}


def test_checkpoint_against_the_fake(fake, capsys):
    servicer, address = fake
    job = servicer.add_job("train", state=common_pb2.JOB_STATE_RUNNING)
    code, out, err = cli(capsys, address, "checkpoint", job.id, "--reason", "before upgrade")
    assert code == 0 and err == ""
    assert out.startswith(f"checkpoint requested: job {job.id} (train, RUNNING") and "'before upgrade'" in out
    assert servicer.checkpoints == {job.id: "before upgrade"}
    code, out, err = cli(capsys, address, "checkpoint", job.id)  # the earlier request is kept, and said so
    assert code == 0 and "'before upgrade'" in out and "earlier request" in out
    code, out, err = cli(capsys, address, "checkpoint", job.id, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["job_id"] == job.id and doc["reason"] == "before upgrade"
    assert doc["requested_at"] > 0 and doc["job"]["id"] == job.id and JOB_KEYS <= set(doc["job"])


def test_goodput_table_and_json_against_the_fake(fake, capsys):
    servicer, address = fake
    a = servicer.add_job("alpha", state=common_pb2.JOB_STATE_SUCCEEDED)
    b = servicer.add_job("beta", state=common_pb2.JOB_STATE_PREEMPTING)
    code, out, err = cli(capsys, address, "goodput", "--since", "1970-01-01T00:00:01Z", "--limit", "5")
    assert code == 0 and err == ""
    assert servicer.goodput_requests[-1] == (1.0, 5)
    lines = out.splitlines()
    assert lines[0].startswith("cluster: goodput 75.0% over 2 jobs (GPU time in GPU-h)")
    assert lines[1].split() == ["ALLOCATED", "PRODUCTIVE", "ROLLBACK", "RESTART", "WAITING"]
    assert lines[2].split() == ["2.00", "1.50", "0.25", "0.25", "0.50"]
    header = next(i for i, line in enumerate(lines) if line.startswith("ID"))
    assert lines[header].split() == [
        "ID",
        "NAME",
        "STATE",
        "ATTEMPTS",
        "ALLOCATED",
        "PRODUCTIVE",
        "ROLLBACK",
        "RESTART",
        "WAITING",
        "GOODPUT",
    ]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 :]}
    assert rows[b.id][1:4] == ["beta", "PREEMPTING", "1"] and rows[b.id][-1] == "75.0%"
    assert rows[a.id][1:3] == ["alpha", "SUCCEEDED"]
    code, out, err = cli(capsys, address, "goodput", "--json")
    doc = json.loads(out)
    assert code == 0 and servicer.goodput_requests[-1] == (0.0, 0)
    assert set(doc) == {"cluster", "job_count", "jobs", "tenants", "queues", "next_page_token"}
    assert doc["job_count"] == 2 and doc["tenants"] == [] and doc["queues"] == [] and doc["next_page_token"] == ""
    assert set(doc["cluster"]) == {"allocated", "productive", "rollback", "restart", "waiting", "ratio"}
    assert [(j["job_id"], j["state"]) for j in doc["jobs"]] == [(b.id, "PREEMPTING"), (a.id, "SUCCEEDED")]


def test_checkpoint_errors_against_the_fake(fake, capsys):
    servicer, address = fake
    pending = servicer.add_job("p")
    code, out, err = cli(capsys, address, "checkpoint", pending.id)
    assert code == 1 and out == "" and err.startswith("error: FAILED_PRECONDITION: ")
    code, out, err = cli(capsys, address, "checkpoint", "nope", "--json")
    assert code == 1 and out == "" and err == "error: NOT_FOUND: job nope not found\n"


def test_job_detail_shows_recovery_preemption_and_goodput(fake, capsys):
    servicer, address = fake
    now = time.time()
    victim = servicer.add_job(
        "victim",
        1,
        8,
        state=common_pb2.JOB_STATE_PREEMPTING,
        failures=1,
        preemptions=2,
        preempted_by="abcdef012345",
        preempt_deadline=now + 60,
        goodput=common_pb2.Goodput(
            allocated=7200, productive=3600, rollback=1800, restart=1800, waiting=360, ratio=0.5
        ),
    )
    retry = servicer.add_job("retry", failures=3, not_before=now + 30)
    code, out, err = cli(capsys, address, "job", victim.id)
    assert code == 0 and err == ""
    assert "PREEMPTING" in out and "abcdef012345" in out
    assert any(line.startswith("failures:") and line.endswith(" 1") for line in out.splitlines())
    assert any(line.startswith("preemptions:") and line.endswith(" 2") for line in out.splitlines())
    assert "goodput: 50.0% (productive / allocated)" in out
    assert [line.split() for line in out.splitlines() if line.startswith("  allocated")] == [["allocated", "2.00"]]
    code, out, err = cli(capsys, address, "job", victim.id, "--json")
    doc = json.loads(out)
    assert (doc["state"], doc["failures"], doc["preemptions"], doc["preempted_by"]) == (
        "PREEMPTING",
        1,
        2,
        "abcdef012345",
    )
    assert doc["preempt_deadline"] == pytest.approx(now + 60)
    assert doc["goodput"] == {
        "allocated": 7200.0,
        "productive": 3600.0,
        "rollback": 1800.0,
        "restart": 1800.0,
        "waiting": 360.0,
        "ratio": 0.5,
    }
    code, out, err = cli(capsys, address, "job", retry.id)
    assert code == 0 and "retry backoff:" in out and "failures:" in out and "preempting" not in out
    code, out, err = cli(capsys, address, "jobs", "--state", "preempting", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == [victim.id]
    code, out, err = cli(capsys, address, "jobs")
    assert code == 0 and "PREEMPTING" in out


# -- checkpoint, goodput and priority classes against the real scheduler ------------------------------------------


class _OneNode(LiteCluster):
    """The real scheduler (in-process, SQLite) and one 8-GPU LiteAgent; preemption with no minimum runtime."""

    def __init__(self, db_url: str) -> None:
        super().__init__(
            SchedulerSettings(
                db_url=db_url,
                listen="127.0.0.1:0",
                fabric=default_fabric(["node-0"]),
                preemption=PreemptionPolicy(min_runtime_s=0.0, grace_period_s=60.0),
                preemption_poll_s=0.1,
                poll_interval=0.2,
            ),
            lambda address: [LiteAgent(address, "node-0")],
        )


async def _real_cli(capsys, address, *argv) -> tuple[int, str, str]:
    """The CLI in a worker thread: its client is synchronous and the scheduler lives on this event loop."""
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _consistent(g: dict) -> None:
    assert set(g) == {"allocated", "productive", "rollback", "restart", "waiting", "ratio"}
    assert abs(g["allocated"] - (g["productive"] + g["rollback"] + g["restart"])) <= 1e-6
    assert all(g[k] >= 0 for k in g)


async def test_checkpoint_goodput_and_priority_classes_against_the_real_scheduler(sqlite_url, capsys, service_logs):
    async with _OneNode(sqlite_url) as c:
        address = c.scheduler.address
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "low",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--priority",
            "batch",
            "--json",
            "--",
            "run",
        )
        assert code == 0, err
        low = json.loads(out)
        assert low["priority"] == -100
        await c.wait_running(low["id"])
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "waits",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--priority",
            "-100",
            "--json",
            "--",
            "run",
        )
        assert code == 0, err
        waits = json.loads(out)

        # checkpoint: a running job gets a request row; a pending one and an unknown one are refused
        code, out, err = await _real_cli(capsys, address, "checkpoint", low["id"], "--reason", "test", "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert (doc["job_id"], doc["reason"], doc["job"]["state"]) == (low["id"], "test", "RUNNING")
        assert doc["requested_at"] > 0
        assert c.sql("SELECT job_id, reason FROM checkpoint_requests") == [(low["id"], "test")]
        code, out, err = await _real_cli(capsys, address, "checkpoint", waits["id"])
        assert code == 1 and out == "" and err.startswith("error: FAILED_PRECONDITION: ") and err.count("\n") == 1
        code, out, err = await _real_cli(capsys, address, "checkpoint", "0123456789ab")
        assert code == 1 and out == "" and err.startswith("error: NOT_FOUND: ")
        assert c.sql("SELECT count(*) FROM checkpoint_requests") == [(1,)]

        # goodput: the cluster and each job add up
        code, out, err = await _real_cli(capsys, address, "goodput", "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["job_count"] == 2 and {j["job_id"] for j in report["jobs"]} == {low["id"], waits["id"]}
        _consistent(report["cluster"])
        for j in report["jobs"]:
            _consistent(j["goodput"])
        running = next(j for j in report["jobs"] if j["job_id"] == low["id"])
        assert running["state"] == "RUNNING" and running["attempts"] == 1 and running["goodput"]["allocated"] > 0
        code, out, err = await _real_cli(capsys, address, "goodput", "--since", str(time.time() + 3600), "--json")
        assert code == 0 and json.loads(out)["job_count"] == 0
        code, out, err = await _real_cli(capsys, address, "goodput")
        assert code == 0 and out.startswith("cluster: goodput ") and low["id"] in out

        # job --json: the new fields (goodput from GetJob)
        code, out, err = await _real_cli(capsys, address, "job", low["id"], "--json")
        assert code == 0, err
        job = json.loads(out)
        assert JOB_KEYS <= set(job)
        assert (
            job["failures"],
            job["preemptions"],
            job["not_before"],
            job["preempted_by"],
            job["preempt_deadline"],
        ) == (0, 0, 0.0, "", 0.0)
        _consistent(job["goodput"])

        # --priority high preempts the batch job: it is PREEMPTING (asked to checkpoint) while it holds the GPUs
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "urgent",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--priority",
            "high",
            "--json",
            "--",
            "run",
        )
        assert code == 0, err
        urgent = json.loads(out)
        assert urgent["priority"] == 100

        async def preempting():
            job = await c.job(low["id"])
            return job if job.state == common_pb2.JOB_STATE_PREEMPTING else None

        await eventually(preempting, what="the batch job PREEMPTING")
        code, out, err = await _real_cli(capsys, address, "jobs", "--state", "preempting", "--json")
        assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == [low["id"]]
        code, out, err = await _real_cli(capsys, address, "job", low["id"])
        assert code == 0 and "PREEMPTING" in out and f"for {urgent['id']}" in out and "goodput:" in out
        code, out, err = await _real_cli(capsys, address, "job", low["id"], "--json")
        job = json.loads(out)
        assert job["state"] == "PREEMPTING" and job["preempted_by"] == urgent["id"]
        assert job["preempt_deadline"] > time.time()


async def test_queue_and_quota_verbs_against_the_real_scheduler(sqlite_url, capsys, service_logs):
    async with _OneNode(sqlite_url) as c:
        address = c.scheduler.address
        code, out, err = await _real_cli(
            capsys,
            address,
            "quota",
            "set",
            "team-a",
            "--quota",
            "H100=8,borrow=0",
            "--quota",
            "*=0,mig=7",
            "--weight",
            "2",
            "--json",
        )
        assert code == 0, err
        queue = json.loads(out)
        assert (
            queue["name"] == "team-a"
            and queue["weight"] == 2
            and [q["flavor"] for q in queue["quotas"]] == ["H100", "*"]
            and queue["quotas"][0]["borrow_limit"] == 0
            and queue["quotas"][1]["mig_slices"] == 7
        )
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "a",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "8",
            "--queue",
            "team-a",
            "--json",
            "--",
            "run",
        )
        assert code == 0, err
        first = json.loads(out)
        await c.wait_running(first["id"])
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "b",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "4",
            "--queue",
            "team-a",
            "--json",
            "--",
            "run",
        )
        second = json.loads(out)
        code, out, err = await _real_cli(capsys, address, "queue", "team-a", "--json")
        assert code == 0, err
        (shown,) = json.loads(out)
        assert shown["running"] == 1 and shown["usage"] == [
            {"flavor": "H100", "gpus": 8.0, "mig_slices": 0, "borrowing": False}
        ]
        assert [(p["job_id"], p["position"]) for p in shown["pending"]] == [(second["id"], 1)]
        assert "over queue 'team-a'" in shown["pending"][0]["message"]
        code, out, err = await _real_cli(capsys, address, "queue")
        assert code == 0 and "queue team-a" in out and "H100" in out and "#1" in out
        code, out, err = await _real_cli(capsys, address, "job", first["id"], "--json")
        assert json.loads(out)["queue"] == "team-a" and json.loads(out)["flavor"] == "H100"
        for bad in (["--quota", "H100"], ["--quota", "H100=x"], ["--quota", "H100=1,foo=2"]):
            code, out, err = await _real_cli(capsys, address, "quota", "set", "q2", *bad)
            assert code == 2 and out == "", err
        code, out, err = await _real_cli(capsys, address, "quota", "delete", "team-a")
        assert code == 1 and "FAILED_PRECONDITION" in err
        code, out, err = await _real_cli(
            capsys,
            address,
            "submit",
            "--name",
            "x",
            "--replicas",
            "1",
            "--gpus-per-replica",
            "1",
            "--queue",
            "nope",
            "--",
            "run",
        )
        assert code == 1 and "no queue 'nope'" in err
