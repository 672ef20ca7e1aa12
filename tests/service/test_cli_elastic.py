"""`phalanx submit --replicas MIN:MAX` (an elastic gang), `phalanx job` and `phalanx jobs --json` against the real
scheduler with LiteAgents; `--replicas N` is unchanged, and a bad range is a usage error (exit code 2)."""

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
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def submit_argv(name: str, replicas: str) -> list[str]:
    return ["submit", "--name", name, "--replicas", replicas, "--gpus-per-replica", "8", "--json", "--", "run"]


async def test_an_elastic_range_through_the_cli(sqlite_url, capsys):
    settings = SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0", poll_interval=0.2)
    async with LiteCluster(settings, lambda a: [LiteAgent(a, "node-0"), LiteAgent(a, "node-1")]) as c:
        address = c.scheduler.address
        code, out, err = await cli(capsys, address, *submit_argv("elastic", "1:4"))
        assert code == 0, err
        job = json.loads(out)
        assert (job["replicas"], job["min_replicas"]) == (4, 1)

        async def running():
            code, out, _ = await cli(capsys, address, "jobs", "--json")
            (listed,) = [j for j in json.loads(out)["jobs"] if j["id"] == job["id"]]
            return listed if listed["state"] == "RUNNING" else None

        listed = await eventually(running, what="the elastic gang running")
        assert listed["current_replicas"] == 2 and len(listed["allocations"]) == 2  # all that fit of its 4
        code, out, _ = await cli(capsys, address, "job", job["id"])
        assert code == 0 and "elastic:" in out and "1 to 4 replicas; runs with 2" in out
        code, out, _ = await cli(capsys, address, "jobs")
        assert "1:4x8" in out

        code, out, err = await cli(capsys, address, *submit_argv("plain", "2"))  # --replicas N, as ever
        assert code == 0, err
        plain = json.loads(out)
        assert (plain["replicas"], plain["min_replicas"], plain["current_replicas"]) == (2, 0, 0)


@pytest.mark.parametrize(
    "replicas, text",
    [("3:2", "MIN <= MAX"), ("0:2", "both be at least 1"), ("0", "must be at least 1, got 0"), ("a:b", "MIN:MAX")],
)
async def test_a_bad_range_is_a_usage_error(capsys, replicas, text):
    code = await asyncio.to_thread(main, ["--scheduler", "127.0.0.1:1", *submit_argv("bad", replicas)])
    _, err = capsys.readouterr()
    assert code == 2 and text in err
