"""How long this scheduler process was stalled, and how much of it the nodes' leases were given back already.

The RPC handlers that take heartbeats run on the process's event loop, so while it stalls (the process paused or
starved of CPU, a long collection, a blocking call on the loop) no heartbeat is heard, however punctually the agents
send. A node's lease measures how long it was silent while this scheduler listened: a stall must not count.
"""

from __future__ import annotations

import asyncio
import time

# The watchdog looks this often whether the loop ran on time; a tick later than TOLERANCE_S past it was a stall.
TICK_S = 0.05
TOLERANCE_S = 0.05


class StallWatch:
    def __init__(self) -> None:
        self.stalled = 0.0  # seconds the event loop was stalled in all, as the watchdog measured it
        self.tick_at = time.monotonic()  # when the watchdog last ran (monotonic)
        self.credited = 0.0  # how much of `stalled` the leases were given back already

    async def watch(self) -> None:
        """The watchdog (a task on the event loop): how much later than asked the loop wakes it."""
        self.tick_at = time.monotonic()
        while True:
            before = time.monotonic()
            await asyncio.sleep(TICK_S)
            self.tick_at = now = time.monotonic()
            late = now - before - TICK_S
            if late > TOLERANCE_S:
                self.stalled += late

    def take_credit(self) -> float:
        """The stall time not given back to the leases yet (seconds; 0 when none), now counted as given. Counts
        the stall under way too: the watchdog may not have run since it began. (Any thread.)"""
        ongoing = time.monotonic() - self.tick_at - TICK_S
        stalled = self.stalled + (ongoing if ongoing > TOLERANCE_S else 0.0)
        credit = stalled - self.credited
        if credit <= 0:
            return 0.0
        self.credited = stalled
        return credit
