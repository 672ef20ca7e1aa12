"""Waiting in tests: on a condition, with a deadline that names what was waited for; never a fixed sleep.

- `eventually(check, timeout=, what=)`: poll an async check until it returns something truthy.
- `wait_until(check, timeout=, what=)`: the same for a plain (blocking) check, from a thread or synchronous test.
- `next_message(call, timeout=, what=)`: the next message of a server stream, or a failure naming what was awaited
  (a stream read has no deadline of its own: a message never sent would hang the test until pytest's timeout).
- `next_cycle(service)`: wait until the in-process scheduler has run a whole cycle that began after the call (what
  it decides on what happened before is then committed: a test asserting that nothing happened asserts it after
  this, not after a sleep).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.scheduler.transitions import CycleCommand


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


async def next_message(call: Any, *, timeout: float = 15.0, what: str = "the next message") -> Any:
    """The next message of a server-streaming call (grpc.aio), failing after `timeout` with what was awaited."""
    try:
        return await asyncio.wait_for(call.read(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


def wait_until(
    check: Callable[[], Any], *, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    """Poll a plain check until it returns something truthy; fail with the last value after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


async def holds(check: Callable[[], Any]) -> Any:
    """`check()` as an awaitable, for `eventually` on a plain condition."""
    return check()


class _Noop(CycleCommand):
    """A scheduler command that changes nothing: it only makes the scheduler run a cycle."""

    def execute(self, cycle) -> None:
        return None


async def next_cycle(service) -> None:
    """Wait until `service` (a SchedulerService in this process) has committed a cycle begun after this call: its
    timers fired and its scheduling pass decided on everything that happened before."""
    await service.execute(_Noop())
