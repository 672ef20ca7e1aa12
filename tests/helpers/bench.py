"""Run a script of bench/ the way a user does (a subprocess, from the repository's root) and read its figures: the
last line it prints on stdout is one JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def bench_server(pg_url: str) -> str:
    """The PostgreSQL database a bench creates its own databases beside: PHALANX_BENCH_PG, else the test server's
    `test` database."""
    return os.environ.get("PHALANX_BENCH_PG", pg_url.rsplit("/", 1)[0] + "/test")


def run_bench(script: str, *args: str, timeout: float = 240) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """Run bench/`script` with `args`; it must exit 0. Returns (its JSON line, the finished process)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc
