"""`phalanx submit --after/--array`, `phalanx jobs` (an array on one line; --expand lists its tasks) and `phalanx
job` (dependencies, array progress) against the real scheduler with LiteAgents."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually

from phalanx.cli.main import main
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(60)


async def cli(capsys, address, *argv) -> tuple[int, str, str]:
    """The CLI in a worker thread: its client is synchronous and the scheduler lives on this event loop."""
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def submit_argv(name: str, *extra: str, command: tuple[str, ...] = ("sleep", "0.2")) -> list[str]:
    return ["submit", "--name", name, "--replicas", "1", "--gpus-per-replica", "8", *extra, "--json", "--", *command]


async def test_array_and_dependency_through_the_cli(sqlite_url, capsys):
    settings = SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0", poll_interval=0.2)
    async with LiteCluster(settings, lambda a: [LiteAgent(a, "node-0"), LiteAgent(a, "node-1")]) as c:
        address = c.scheduler.address
        code, out, err = await cli(capsys, address, *submit_argv("sweep", "--array", "0-5%2"))
        assert code == 0, err
        array = json.loads(out)
        assert array["array_spec"] == "0-5%2" and array["array"]["tasks"] == 6 and array["array"]["limit"] == 2
        assert array["array_parent"] == "" and array["array_task"] == -1
        code, out, err = await cli(
            capsys, address, *submit_argv("report", "--after", f"{array['id']}:ok", command=("sleep", "0.05"))
        )
        assert code == 0, err
        report = json.loads(out)
        assert report["after"] == [{"job_id": array["id"], "condition": "ok"}]
        assert (
            report["waiting_for"] == report["after"] and report["message"] == f"waits for job {array['id']} to succeed"
        )

        code, out, _ = await cli(capsys, address, "job", report["id"])
        assert code == 0 and "after:" in out and f"{array['id']}:ok (waiting)" in out

        async def some_tasks():
            code, out, _ = await cli(capsys, address, "jobs", "--json")
            jobs = json.loads(out)["jobs"]
            tasks = [j for j in jobs if j["array_parent"] == array["id"]]
            return (jobs, tasks) if tasks else None

        jobs, tasks = await eventually(some_tasks, what="the array's first tasks")
        assert all(t["name"].startswith("sweep[") and 0 <= t["array_task"] <= 5 for t in tasks)
        code, out, _ = await cli(capsys, address, "jobs")
        lines = out.splitlines()
        assert sum(1 for line in lines if "sweep" in line) == 1  # the array is one line
        assert any("6 tasks:" in line for line in lines), out
        code, out, _ = await cli(capsys, address, "jobs", "--expand")
        assert sum(1 for line in out.splitlines() if "sweep[" in line) >= 1

        async def report_done():
            code, out, _ = await cli(capsys, address, "job", report["id"], "--json")
            job = json.loads(out)
            return job if job["state"] == "SUCCEEDED" else None

        await eventually(report_done, timeout=40, what="the dependent job succeeded")
        code, out, _ = await cli(capsys, address, "job", array["id"])
        assert "array:" in out and "0-5%2: 6 tasks: 0 running, 6 done" in out, out


async def test_bad_graph_flags_are_usage_errors_before_any_call(capsys):
    for extra, words in [
        (("--after", "abc:maybe"), "the condition must be ok, notok or any"),
        (("--after", ":ok"), "a job id is missing"),
        (("--array", "3-1"), "ends before it starts"),
        (("--array", "0-9%"), "after '%'"),
    ]:
        code, out, err = await cli(capsys, "127.0.0.1:1", *submit_argv("bad", *extra))
        assert code == 2 and out == "" and words in err, (extra, err)
