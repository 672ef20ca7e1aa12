"""The `phalanx` CLI end to end, via main([...]) against a real gRPC fake scheduler: JSON on stdout and nothing
else, exit codes, stderr error lines, `--` command handling, reserved flags, and `phalanx db upgrade`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx.api.v1 import common_pb2
from phalanx.cli.main import GPU_SUBMIT_FLAGS, RESERVED_SUBMIT_FLAGS, TIER_SUBMIT_FLAGS, main

pytestmark = pytest.mark.timeout(30)

# The fake scheduler lives in test_client.py; load it by path so this works under any pytest import mode.
_spec = importlib.util.spec_from_file_location("_phalanx_fake_scheduler", Path(__file__).with_name("test_client.py"))
_fake_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fake_mod)
serve_fake = _fake_mod.serve_fake
closed_port_address = _fake_mod.closed_port_address
JOB_KEYS = _fake_mod.JOB_KEYS

ROOT = Path(__file__).resolve().parent.parent


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
    code, out, err = cli(capsys, address, "submit", "--name", "train", "--replicas", "2", "--gpus-per-replica", "4",
                         "--priority", "7", "--procs-per-replica", "1", "--env", "A=1", "B=x=y", "--env", "C=",
                         "--json", "--", "torchrun", "--nproc", "4", "train.py", "--", "--lr", "3e-4")
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
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         "python", "x.py")
    assert code == 0 and err == ""
    (job_id,) = servicer.jobs
    assert "id:" in out and job_id in out and "PENDING" in out and "python x.py" in out
    assert list(servicer.jobs[job_id].spec.command) == ["python", "x.py"]


def test_submit_without_a_command_is_a_usage_error(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         "--")
    assert code == 2 and out == "" and err.startswith("error: a command is required")
    assert servicer.calls == {}


@pytest.mark.parametrize("flag", RESERVED_SUBMIT_FLAGS)
@pytest.mark.parametrize("with_value", [True, False])
def test_reserved_submit_flags_are_rejected(fake, capsys, flag, with_value):
    servicer, address = fake
    extra = [flag, "x"] if with_value else [flag]
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         *extra, "--json", "--", "true")
    assert code == 2 and out == ""
    assert err == f"error: {flag} is not supported yet\n"
    assert servicer.calls == {}


def test_reserved_flag_names_are_exactly_the_contract():
    # The tier and GPU flags were reserved names and are now supported under exactly those names; the rest stay
    # refused.
    assert set(TIER_SUBMIT_FLAGS) == {"--required-tier", "--preferred-tier"}
    assert set(GPU_SUBMIT_FLAGS) == {"--mig", "--gpu-milli", "--gpu-model"}
    assert set(RESERVED_SUBMIT_FLAGS) == {"--time-limit", "--queue"}


def test_submit_gpu_flags_reach_the_scheduler_and_the_json(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "2", "--mig", "3g.40gb",
                         "--gpu-model", "H100", "--json", "--", "true")
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.mig_profile, spec.gpu_model, spec.gpu_milli, spec.gpus_per_replica) == ("3g.40gb", "H100", 0, 1)
    assert (job["mig_profile"], job["gpu_model"], job["gpu_milli"]) == ("3g.40gb", "H100", 0)
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpu-milli", "250",
                         "--json", "--", "true")
    assert code == 0, err
    spec = servicer.jobs[json.loads(out)["id"]].spec
    assert (spec.gpu_milli, spec.mig_profile, spec.gpus_per_replica) == (250, "", 1)


def test_gpus_per_replica_is_required_for_whole_gpus(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--json", "--", "true")
    assert code == 2 and out == "" and "--gpus-per-replica is required" in err
    assert servicer.calls == {}


@pytest.mark.parametrize("flag", ["--mig", "--gpu-milli", "--gpu-model"])
def test_gpu_flag_without_a_value_is_a_usage_error(fake, capsys, flag):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         "--json", flag, "--", "true")
    assert code == 2 and out == "" and flag in err
    assert servicer.calls == {}


def test_submit_tier_flags_reach_the_scheduler_and_the_json(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "2", "--gpus-per-replica", "8",
                         "--required-tier", "leaf", "--preferred-tier", "node", "--json", "--", "true")
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.required_tier, spec.preferred_tier) == ("leaf", "node")
    assert (job["required_tier"], job["preferred_tier"]) == ("leaf", "node")


def test_submit_without_tier_flags_sends_no_constraint(fake, capsys):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         "--json", "--", "true")
    assert code == 0, err
    job = json.loads(out)
    spec = servicer.jobs[job["id"]].spec
    assert (spec.required_tier, spec.preferred_tier) == ("", "")
    assert (job["required_tier"], job["preferred_tier"]) == ("", "")


@pytest.mark.parametrize("flag", TIER_SUBMIT_FLAGS)
def test_tier_flag_without_a_value_is_a_usage_error(fake, capsys, flag):
    servicer, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1",
                         "--json", flag, "--", "true")
    assert code == 2 and out == "" and "error:" in err and flag in err
    assert servicer.calls == {}


@pytest.mark.parametrize("argv", [
    ["submit", "--name", "t", "--replicas", "1", "--gpus-per-replica", "1", "--env", "NOEQUALS", "--", "true"],
    ["submit", "--name", "t", "--replicas", "two", "--gpus-per-replica", "1", "--", "true"],
    ["submit", "--replicas", "1", "--gpus-per-replica", "1", "--", "true"],
    ["jobs", "--state", "DONE"],
    ["frobnicate"],
    [],
])
def test_usage_errors_exit_2_with_stderr_only(fake, capsys, argv):
    servicer, address = fake
    code, out, err = cli(capsys, address, *argv)
    assert code == 2 and out == "" and "error:" in err
    assert servicer.calls == {}


def test_server_rejection_is_exit_1_with_code_name(fake, capsys):
    _, address = fake
    code, out, err = cli(capsys, address, "submit", "--name", "t", "--replicas", "0", "--gpus-per-replica", "1",
                         "--json", "--", "true")
    assert code == 1 and out == ""
    assert err == "error: INVALID_ARGUMENT: replicas and gpus_per_replica must be positive\n"


# -- jobs / job / cancel / nodes --------------------------------------------------------------------------------


def _seed(servicer):
    a = servicer.add_job("alpha", 2, 4, state=common_pb2.JOB_STATE_SUCCEEDED, finished_at=time.time(),
                         allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=[0, 1, 2, 3]),
                                      common_pb2.Allocation(replica=1, node="gpu-b", gpus=[0, 1, 2, 3])])
    b = servicer.add_job("beta", 1, 8, state=common_pb2.JOB_STATE_RUNNING, priority=10,
                         allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=list(range(8)))])
    c = servicer.add_job("gamma", 4, 8)
    return a, b, c


def test_jobs_json_is_one_array_newest_first_with_finished_jobs(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, err = cli(capsys, address, "jobs", "--json")
    assert code == 0 and err == ""
    jobs = json.loads(out)
    assert isinstance(jobs, list) and [j["id"] for j in jobs] == [c.id, b.id, a.id]
    assert all(JOB_KEYS <= set(j) for j in jobs)
    assert jobs[2]["state"] == "SUCCEEDED"
    assert jobs[2]["allocations"] == [{"replica": 0, "node": "gpu-a", "gpus": [0, 1, 2, 3]},
                                      {"replica": 1, "node": "gpu-b", "gpus": [0, 1, 2, 3]}]
    assert jobs[1]["priority"] == 10


def test_jobs_state_filter(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, _ = cli(capsys, address, "jobs", "--state", "running", "PENDING", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)] == [c.id, b.id]
    code, out, _ = cli(capsys, address, "jobs", "--state", "SUCCEEDED", "--state", "FAILED", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)] == [a.id]
    code, out, _ = cli(capsys, address, "jobs", "--state", "CANCELLED", "--json")
    assert code == 0 and json.loads(out) == []


def test_jobs_table_is_aligned(fake, capsys):
    servicer, address = fake
    a, b, c = _seed(servicer)
    code, out, err = cli(capsys, address, "jobs")
    assert code == 0 and err == ""
    lines = out.rstrip("\n").splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATE", "PRI", "GANG", "NODES", "AGE"]
    assert len(lines) == 4
    header = lines[0]
    for column in ("NAME", "STATE", "PRI", "GANG", "NODES", "AGE"):
        start = header.index(column)
        for row in lines[1:]:
            assert row[start - 2:start] == "  " and row[start] != " ", (column, row)
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows[a.id][1:6] == ["alpha", "SUCCEEDED", "0", "2x4", "gpu-a,gpu-b"]
    assert rows[b.id][1:6] == ["beta", "RUNNING", "10", "1x8", "gpu-a"]
    assert rows[c.id][1:6] == ["gamma", "PENDING", "0", "4x8", "-"]


def test_job_and_cancel(fake, capsys):
    servicer, address = fake
    _, b, _ = _seed(servicer)
    code, out, err = cli(capsys, address, "job", b.id, "--json")
    assert code == 0 and err == "" and json.loads(out)["id"] == b.id
    code, out, err = cli(capsys, address, "job", b.id)
    assert code == 0 and b.id in out and "gpu-a" in out and "RUNNING" in out
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
        ("gpu-a", 8, 6, "READY"), ("gpu-b", 8, 8, "DRAINED")]
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
    code, out, err = run(capsys, "--scheduler", address, "--timeout", "3", "jobs", "--json")
    assert code == 1 and out == ""
    assert err.startswith(f"error: UNAVAILABLE: cannot reach scheduler at {address}")
    assert err.count("\n") == 1  # one line, no traceback


def test_default_address_when_nothing_is_set(capsys, monkeypatch):
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    import phalanx.cli.main as cli_main

    seen = {}
    real = cli_main.Client

    def spy(target, **kw):
        c = real(target, **kw)
        seen["target"] = c.target
        return c

    monkeypatch.setattr(cli_main, "Client", spy)
    run(capsys, "--timeout", "1", "nodes")
    assert seen["target"] == "127.0.0.1:50051"


# -- watch -----------------------------------------------------------------------------------------------------


def test_watch_prints_a_line_per_change_until_all_finish(fake, capsys):
    servicer, address = fake
    j1 = servicer.add_job("one")
    j2 = servicer.add_job("two", state=common_pb2.JOB_STATE_RUNNING)
    done = servicer.add_job("done", state=common_pb2.JOB_STATE_SUCCEEDED)

    def drive():
        time.sleep(0.3)
        servicer.update(j1.id, state=common_pb2.JOB_STATE_RUNNING,
                        allocations=[common_pb2.Allocation(replica=0, node="gpu-a", gpus=[0])])
        time.sleep(0.1)
        servicer.update(j2.id, state=common_pb2.JOB_STATE_FAILED, exit_code=2, message="rank 0 exited 2")
        time.sleep(0.1)
        servicer.update(j1.id, state=common_pb2.JOB_STATE_SUCCEEDED)

    t = threading.Thread(target=drive)
    t.start()
    code, out, err = cli(capsys, address, "watch", j1.id, j2.id, done.id)
    t.join()
    assert code == 0 and err == ""
    lines = out.splitlines()
    got = [(line.split()[1], line.split()[3]) for line in lines]
    assert got == [(j1.id, "PENDING"), (j2.id, "RUNNING"), (done.id, "SUCCEEDED"),
                   (j1.id, "RUNNING"), (j2.id, "FAILED"), (j1.id, "SUCCEEDED")]
    assert "rank 0 exited 2" in lines[4] and "exit_code=2" in lines[4] and "nodes=gpu-a" in lines[3]


def test_watch_json_lines(fake, capsys):
    servicer, address = fake
    j = servicer.add_job("one")
    threading.Timer(0.3, servicer.update, (j.id,), {"state": common_pb2.JOB_STATE_CANCELLED}).start()
    code, out, err = cli(capsys, address, "watch", "--json", j.id)
    assert code == 0 and err == ""
    states = [json.loads(line)["state"] for line in out.splitlines()]
    assert states == ["PENDING", "CANCELLED"]


# -- db upgrade / misc -------------------------------------------------------------------------------------------


def test_db_upgrade_on_a_temp_sqlite_file(tmp_path, capsys):
    from db.migrate import current

    url = f"sqlite:///{tmp_path / 'sub' / 'phalanx.db'}"
    (tmp_path / "sub").mkdir()
    code, out, err = run(capsys, "db", "upgrade", "--db", url, "--json")
    assert code == 0, err
    assert json.loads(out) == {"db": url, "revision": "0005"}
    assert current(url) == "0005"
    code, out, err = run(capsys, "db", "upgrade", "--db", url)  # idempotent
    assert code == 0 and "0005" in out


def test_db_upgrade_url_from_env(tmp_path, capsys, monkeypatch):
    from db.migrate import current

    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("PHALANX_DB", url)
    code, out, err = run(capsys, "db", "upgrade")
    assert code == 0, err
    assert current(url) == "0005"


def test_db_upgrade_failure_is_one_error_line(tmp_path, capsys):
    code, out, err = run(capsys, "db", "upgrade", "--db", "nosuchdialect://x/y")
    assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "submit" in out and "nodes" in out


def test_console_entry_point_in_a_subprocess(fake):
    _, address = fake
    env = {**os.environ, "PHALANX_SCHEDULER": address}
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "nodes", "--json"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert [n["name"] for n in json.loads(proc.stdout)] == ["gpu-a", "gpu-b"]
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "job", "nope"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=20)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "error: NOT_FOUND: job nope not found\n"
