"""`phalanx submit --segment S --segment-tier T` and `phalanx job` against the real scheduler (LiteCluster): the flags
reach the JobSpec, `--json` gains segment, segment_tier and segment_domains, and the human view lists each segment's
domain and ranks. A --segment that does not divide --replicas is the scheduler's INVALID_ARGUMENT (exit 1)."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.lite_cluster import LiteCluster

from phalanx.cli.main import main
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.testing.lite_agent import LiteAgent
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(30)

NAMES = [f"node-{i}" for i in range(4)]
FABRIC = group_nvlink_domains(default_fabric(NAMES, nodes_per_leaf=4), 2)  # nvl-0, nvl-1 of 2 nodes, one leaf


async def _cli(capsys, address, *argv) -> tuple[int, str, str]:
    """The CLI in a worker thread: its client is synchronous and the scheduler lives on this event loop."""
    code = await asyncio.to_thread(main, ["--scheduler", address, "--timeout", "10", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_submit_segment_flags_and_job_shows_the_segments(sqlite_url, capsys):
    settings = SchedulerSettings(db_url=sqlite_url, listen="127.0.0.1:0", fabric=FABRIC)
    async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n, gpus=4) for n in NAMES]) as c:
        address = c.scheduler.address
        submit = ("submit", "--name", "seg", "--replicas", "4", "--gpus-per-replica", "4")
        code, out, err = await _cli(
            capsys, address, *submit, "--segment", "2", "--segment-tier", "nvlink", "--json", "--", "run"
        )
        assert code == 0, err
        job = json.loads(out)
        assert (job["segment"], job["segment_tier"]) == (2, "nvlink")
        running = await c.wait_running(job["id"])
        assert sorted(running.segment_domains) == ["nvl-0", "nvl-1"]

        code, out, err = await _cli(capsys, address, "job", job["id"], "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["segment_domains"] == list(running.segment_domains)
        assert shown["allocations"] and shown["placement"]["tier"] == "leaf"  # nothing removed

        code, out, err = await _cli(capsys, address, "job", job["id"])
        assert code == 0, err
        first, second = running.segment_domains
        assert "segments:" in out and f"2 x 2 replicas, each in one nvlink: {first} (0-1), {second} (2-3)" in out

        code, out, err = await _cli(capsys, address, *submit, "--segment", "3", "--", "run")
        assert code == 1 and "segment 3 does not divide replicas 4" in err
        code, out, err = await _cli(capsys, address, *submit, "--segment", "0", "--", "run")
        assert code == 2 and "--segment must be at least 1" in err
