"""The fan-out after a commit: job changes to the watchers of WatchJobs, assignments to the nodes' streams.

Both live in this replica's memory only. A change another replica committed arrives through the ledger instead
(LISTEN/NOTIFY in service.py): watchers then get the jobs read back from the ledger, and node streams a wake-up
(None) that sends them to the ledger for their assignments.
"""

from __future__ import annotations

import asyncio
from typing import Any

from phalanx.api.v1 import common_pb2

Watcher = tuple[frozenset[str] | None, asyncio.Queue]


class FanOut:
    def __init__(self) -> None:
        self._watchers: set[Watcher] = set()
        self._feeds: dict[str, set[asyncio.Queue]] = {}

    # ---- WatchJobs ------------------------------------------------------------------------------------------------

    @property
    def watched(self) -> bool:
        return bool(self._watchers)

    def subscribe(self, job_ids: frozenset[str] | None) -> Watcher:
        """A queue of the changed jobs among `job_ids` (None: every job)."""
        entry: Watcher = (job_ids, asyncio.Queue())
        self._watchers.add(entry)
        return entry

    def unsubscribe(self, entry: Watcher) -> None:
        self._watchers.discard(entry)

    def publish(self, job: common_pb2.Job) -> None:
        for ids, queue in list(self._watchers):
            if ids is None or job.id in ids:
                queue.put_nowait(job)

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
