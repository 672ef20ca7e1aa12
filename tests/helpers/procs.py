"""Start Phalanx services as real processes for tests, and wait for conditions without scattered sleeps."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess:
    """A service started as `python -m MODULE ARGS`, whose stderr announces `<what> at HOST:PORT`."""

    def __init__(
        self,
        module: str,
        args: list[str],
        log_path: Path,
        announce: str = "scheduler at",
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """`prefix`: a command the service runs under (e.g. `ip netns exec NS`, a test host's namespace)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), PHALANX_LOG_LEVEL="INFO", **(env or {}))
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", module, *args],
            stdout=self.log,
            stderr=self.log,
            env=env,
            cwd=str(ROOT),
        )
        self.address = self._wait_for(announce)

    def _wait_for(self, announce: str, timeout: float = 30.0) -> str:
        deadline = time.time() + timeout
        pattern = re.compile(re.escape(announce) + r" (\S+:\d+)")
        while time.time() < deadline:
            match = pattern.search(self.log_path.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"service did not announce itself:\n{self.log_path.read_text()[-3000:]}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


def start_scheduler(db_url: str, log_path: Path, *extra: str) -> ServiceProcess:
    return ServiceProcess("services.scheduler.main", ["--db", db_url, "--listen", "127.0.0.1:0", *extra], log_path)


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    """Poll an async check until it returns something truthy; fail with the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
