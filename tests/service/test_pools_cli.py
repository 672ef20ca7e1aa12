"""`phalanx pool create|list|delete` and `phalanx job` after a swap from a pool, against the real scheduler
(LiteCluster): the table and --json show per domain booked, lent and missing nodes; bad input is the scheduler's
INVALID_ARGUMENT or ALREADY_EXISTS (exit 1), a missing flag a usage error (exit 2); `phalanx job` of a gang that
swapped a pool node in names the pool."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.two_domains import FABRIC, NAMES
from helpers.waits import eventually

from phalanx.api.v1 import common_pb2
from phalanx.cli.main import main
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(60)


async def _cli(capsys, address, *argv) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_pool_verbs_and_job_after_a_pool_swap(sqlite_url, capsys):
    settings = SchedulerSettings(
        db_url=sqlite_url, listen="127.0.0.1:0", fabric=FABRIC, lease_timeout=1.0, heartbeat_interval=0.2
    )
    async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n, gpus=4) for n in NAMES]) as c:
        address = c.scheduler.address
        code, out, err = await _cli(capsys, address, "pool", "create", "spare", "--tier", "nvlink", "--per-domain", "1")
        assert code == 0, err
        assert out.startswith("POOL") and "spare" in out

        async def listed():
            code, out, err = await _cli(capsys, address, "pool", "list", "--json")
            assert code == 0, err
            (pool,) = json.loads(out)
            return pool if all(d["booked"] for d in pool["domains"]) else None

        pool = await eventually(listed, what="a node booked per domain")
        assert pool["tier"] == "nvlink" and pool["per_domain"] == 1
        assert [(d["domain"], d["missing"], d["lent"]) for d in pool["domains"]] == [("nvl-0", 0, {}), ("nvl-1", 0, {})]
        booked = {d["domain"]: d["booked"][0] for d in pool["domains"]}

        code, out, err = await _cli(capsys, address, "pool", "create", "x", "--tier", "rack", "--per-domain", "1")
        assert code == 1 and "unknown tier 'rack'" in err
        code, out, err = await _cli(capsys, address, "pool", "create", "spare", "--tier", "nvlink", "--per-domain", "1")
        assert code == 1 and "already exists" in err
        code, out, err = await _cli(capsys, address, "pool", "create", "x", "--tier", "nvlink")
        assert code == 2

        # A time-limited backfill job borrows a pool node: `pool list` shows it lent.
        gang = await c.submit("train", 4, 4)
        await c.wait_running(gang.id)
        borrower = await c.submit("bf", 1, 4, time_limit_s=3600)  # only pool nodes are free now
        await c.wait_running(borrower.id)
        code, out, err = await _cli(capsys, address, "pool", "list")
        assert code == 0, err
        assert f": {borrower.id}" in out

        # A gang node lost: the gang takes the pool node of its domain, and `phalanx job` says so.
        first = await c.job(gang.id)
        dead = first.allocations[0].node
        spare = booked[FABRIC.path(dead)[0]]
        await c.settled(gang.id, borrower.id)
        await next(a for a in c.agents if a.name == dead).partition()

        async def swapped():
            job = await c.job(gang.id)
            return job if job.attempt == 2 and job.state == common_pb2.JOB_STATE_RUNNING else None

        await eventually(swapped, what="the gang restarted on the pool node")
        code, out, err = await _cli(capsys, address, "job", gang.id)
        assert code == 0, err
        assert "swaps:" in out and f"{dead} -> {spare} (pool spare, {FABRIC.path(dead)[0]})" in out

        code, out, err = await _cli(capsys, address, "pool", "delete", "spare", "--json")
        assert code == 0 and json.loads(out) == {"deleted": "spare"}
        code, out, err = await _cli(capsys, address, "pool", "list")
        assert code == 0 and "no spare pools" in out
