"""Background tasks of one agent process: kept referenced until done, cancelled together at shutdown or a crash.

Private to the node agent; imports nothing of the package, so any collaborator can use it without a cycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    """Fire-and-forget tasks (kills, closes, MIG mode switches, log rotation) and worker-thread futures (MIG and
    MPS acquisitions and releases) that shutdown waits for."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()
        self.releases: set[asyncio.Future] = set()  # MIG instance / MPS share work in worker threads

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        t = asyncio.create_task(coro, name=name)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def track(self, fut: asyncio.Future) -> None:
        """A worker-thread future shutdown waits for; forgotten once done."""
        self.releases.add(fut)
        fut.add_done_callback(self.releases.discard)
