"""What the end-to-end tests on `LocalCluster` (real processes) share: a wait on a condition, and a process's
environment read from /proc (to find a job's rank processes on a simulated node). The `cluster_factory` fixture
built on them is in tests/conftest.py."""

from __future__ import annotations

import time
from pathlib import Path


def eventually_sync(check, *, timeout: float, what: str, interval: float = 0.1):
    """`check()`'s first truthy value, polled every `interval` for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def environ_of(pid: int) -> dict[str, str]:
    """A process's environment ({} when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
