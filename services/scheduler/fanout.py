"""The fan-out after a commit: job changes to the watchers of WatchJobs, assignments to the nodes' streams.

Both live in this replica's memory only. A change another replica committed arrives through the ledger instead
(LISTEN/NOTIFY in service.py): watchers then get the jobs read back from the ledger, and node streams a wake-up
(None) that sends them to the ledger for their assignments.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from phalanx.api.v1 import common_pb2


class Watcher:
    """One WatchJobs stream's buffer of changed jobs: the jobs among `job_ids` (None: every job) of `tenant` (None:
    every tenant), at most `limit` of them. A watcher that falls further behind is `overflowed`: its buffer is
    dropped and its stream ended (it watches again, starting from the current state), so memory stays bounded
    whatever a slow reader does."""

    __slots__ = ("job_ids", "tenant", "limit", "items", "overflowed", "_ready")

    def __init__(self, job_ids: frozenset[str] | None, tenant: str | None, limit: int) -> None:
        self.job_ids, self.tenant, self.limit = job_ids, tenant, limit
        self.items: deque[tuple[common_pb2.Job, float]] = deque()
        self.overflowed = False
        self._ready = asyncio.Event()

    def put(self, job: common_pb2.Job, at: float) -> None:
        if self.overflowed:
            return
        if len(self.items) >= self.limit:
            self.overflowed = True
            self.items.clear()
        else:
            self.items.append((job, at))
        self._ready.set()

    async def get(self) -> tuple[common_pb2.Job, float] | None:
        """The next change and when it happened; None once the watcher overflowed."""
        while not self.items and not self.overflowed:
            self._ready.clear()
            await self._ready.wait()
        return None if self.overflowed else self.items.popleft()


class FanOut:
    def __init__(self, watch_queue: int = 10_000) -> None:
        self.watch_queue = watch_queue
        self._watchers: set[Watcher] = set()
        # In-process listeners of every job change (the service controller's wake-up): not streams, not counted
        # among the watchers, never buffered
        self._listeners: list[Callable[[common_pb2.Job], None]] = []
        self._feeds: dict[str, set[asyncio.Queue]] = {}

    # ---- WatchJobs ------------------------------------------------------------------------------------------------

    @property
    def watched(self) -> bool:
        return bool(self._watchers)

    def subscribe(self, job_ids: frozenset[str] | None, tenant: str | None = None) -> Watcher:
        """A buffer of the changed jobs among `job_ids` (None: every job) of `tenant` (None: all)."""
        entry = Watcher(job_ids, tenant, self.watch_queue)
        self._watchers.add(entry)
        return entry

    def unsubscribe(self, entry: Watcher) -> None:
        self._watchers.discard(entry)

    def listen(self, listener: Callable[[common_pb2.Job], None]) -> None:
        """Call `listener(job)` (on the event loop, it must not block) for every job change published."""
        self._listeners.append(listener)

    def unlisten(self, listener: Callable[[common_pb2.Job], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def publish(self, job: common_pb2.Job, at: float) -> None:
        """`job` changed at `at` (unix seconds: its cycle's commit)."""
        for listener in self._listeners:
            listener(job)
        for w in list(self._watchers):
            if (w.job_ids is None or job.id in w.job_ids) and (w.tenant is None or job.tenant == w.tenant):
                w.put(job, at)

    # ---- StreamAssignments ----------------------------------------------------------------------------------------

    def open_feed(self, name: str) -> asyncio.Queue:
        """A queue of (revision, Assignment) for assignments this replica commits for `name`; None means
        "look at the ledger" (another process wrote, or the service is stopping)."""
        feed: asyncio.Queue = asyncio.Queue()
        self._feeds.setdefault(name, set()).add(feed)
        return feed

    def close_feed(self, name: str, feed: asyncio.Queue) -> None:
        self._feeds.get(name, set()).discard(feed)

    def deliver(self, name: str, revision: int, message: Any) -> None:
        for feed in self._feeds.get(name, ()):
            feed.put_nowait((revision, message))

    def wake_node(self, name: str) -> None:
        for feed in self._feeds.get(name, ()):
            feed.put_nowait(None)

    def wake_all_nodes(self) -> None:
        for name in list(self._feeds):
            self.wake_node(name)
