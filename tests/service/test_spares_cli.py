"""`phalanx submit --spares-per-segment K` and `phalanx job` against the real scheduler (LiteCluster): the flag reaches
the JobSpec, `--json` gains spares_per_segment, spares, swaps, last_swap_at and last_swap, and the human view lists
each spare with its domain, booked or missing. A negative K is a usage error (exit 2); spares without --segment are
the scheduler's INVALID_ARGUMENT (exit 1)."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.lite_cluster import LiteCluster
from helpers.two_domains import FABRIC, NAMES

from phalanx.cli.main import main
from phalanx.core import invariants as inv
from phalanx.testing.history import history_from_ledger
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(30)


async def _cli(capsys, address, *argv) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_submit_spares_flag_and_job_shows_the_spares(sqlite_url, capsys):
    settings = SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0", fabric=FABRIC)
    async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n, gpus=4) for n in NAMES]) as c:
        address = c.scheduler.address
        submit = ("submit", "--name", "spare", "--replicas", "4", "--gpus-per-replica", "4")
        code, out, err = await _cli(
            capsys, address, *submit, "--segment", "2", "--spares-per-segment", "1", "--json", "--", "run"
        )
        assert code == 0, err
        job = json.loads(out)
        assert job["spares_per_segment"] == 1 and job["segment"] == 2
        running = await c.wait_running(job["id"])

        code, out, err = await _cli(capsys, address, "job", job["id"], "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert [(s["segment"], s["booked"]) for s in shown["spares"]] == [(0, True), (1, True)]
        assert [s["domain"] for s in shown["spares"]] == list(running.segment_domains)
        assert shown["swaps"] == 0 and shown["last_swap"] == "" and len(shown["allocations"]) == 4

        code, out, err = await _cli(capsys, address, "job", job["id"])
        assert code == 0, err
        spare0, spare1 = running.spares
        assert "spares:" in out and f"1 per segment: {spare0.node} ({spare0.domain}, segment 0)" in out
        assert f"{spare1.node} ({spare1.domain}, segment 1)" in out

        code, out, err = await _cli(capsys, address, *submit, "--spares-per-segment", "1", "--", "run")
        assert code == 1 and "needs segment" in err
        code, out, err = await _cli(
            capsys, address, *submit, "--segment", "2", "--spares-per-segment", "-1", "--", "run"
        )
        assert code == 2 and "--spares-per-segment must be at least 0" in err

    # The ledger's history, judged by the invariants: (i) sees the gang's spares in their domains, apart from its ranks.
    history = history_from_ledger(sqlite_url, tiers=FABRIC.tiers)
    (start,) = [e for e in history if isinstance(e, inv.Started)]
    assert [seg for seg, _ in start.spares] == [0, 1] and len(start.spare_holds) == 8 and len(start.holds) == 24
    assert [v for v in inv.check(history) if v.invariant in ("a", "h", "i", "j")] == []
