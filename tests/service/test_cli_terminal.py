"""The CLI on a real terminal (a pseudo-terminal): `phalanx watch` draws one live table (rich) instead of a line
per change, and `phalanx sim run` draws a progress bar over the trace; piped, both print plain lines (the other
tests). The CLI runs as a real process."""

from __future__ import annotations

import asyncio
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from test_scheduler import SUCCEEDED, Cluster

ROOT = Path(__file__).resolve().parents[2]


def run_in_terminal(argv: list[str], timeout: float = 60.0, cwd: Path | None = None) -> tuple[int, str]:
    """Run `argv` with its stdin, stdout and stderr on a pseudo-terminal of 120 columns; its exit code and
    everything it drew."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="120", LINES="40", TERM="xterm-256color")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end closed (the process exited)
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    return code, b"".join(chunks).decode(errors="replace")


async def test_watch_on_a_terminal_draws_one_live_table(db_url, service_logs):
    async with Cluster(db_url, 1) as c:
        job = await c.submit("tabled", 1, 1, command=("sleep", "1"))
        argv = [sys.executable, "-m", "phalanx.cli.main", "--scheduler", c.scheduler.address, "watch", job.id]
        code, screen = await asyncio.to_thread(run_in_terminal, argv)
        await c.wait_state(job.id, SUCCEEDED)
    assert code == 0, screen
    assert "phalanx watch" in screen and "CHANGED" in screen and "SUCCEEDED" in screen, screen
    assert "━" in screen or "─" in screen  # a drawn table, not lines
    assert f"{job.id} tabled" not in screen  # not the piped line format


def test_sim_run_on_a_terminal_draws_a_progress_bar(tmp_path):
    from phalanx.sim.traces import PHILLY_DIR, TraceJob, write_csv

    (tmp_path / "data" / PHILLY_DIR).mkdir(parents=True)
    trace = tmp_path / "trace.csv"
    write_csv(
        [
            TraceJob(job_id=f"j{i}", tenant="t", submit_s=60.0 * i, replicas=1, gpus_per_replica=8, gpu_milli=0,
                     duration_s=600.0)
            for i in range(40)
        ],
        trace,
    )  # fmt: skip
    argv = [
        sys.executable, "-m", "phalanx.cli.main", "sim", "run", "--trace", f"csv:{trace}", "--cluster", "4x8,leaf=2",
        "--policy", "gang-fifo", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    code, screen = run_in_terminal(argv, cwd=ROOT)
    assert code == 0, screen
    assert "[sim] gang-fifo" in screen and "40/40" in screen and "jobs" in screen, screen
    assert "━" in screen  # rich's bar
    assert "jobs done" not in screen  # not the piped lines
