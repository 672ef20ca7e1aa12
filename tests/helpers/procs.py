"""Start Phalanx services as real processes for tests, and wait for conditions without scattered sleeps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .waits import eventually, wait_until  # noqa: F401  (the waits' home; imported from here too)

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


def start_scheduler(db_url: str, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> ServiceProcess:
    return ServiceProcess(
        "services.scheduler.main", ["--db", db_url, "--listen", "127.0.0.1:0", *extra], log_path, env=env
    )
