"""Leadership: one replica at a time holds a fenced lease on the ledger's clock row, and it alone schedules.

The lease columns change only under the clock row's lock, which every cycle takes first (ledger.begin_cycle), so
a cycle's answer "I lead" holds until its transaction commits. A replica that believed it led and finds another
leader or epoch steps down before writing anything of a scheduling pass: the deposed leader's fencing
(docs/design.md, "Leadership").
"""

from __future__ import annotations

from typing import Any

import structlog

from services.common import metrics

from . import ledger

log = structlog.get_logger()


class Leadership:
    """This replica's view of the lease: the epoch it holds (None: it follows) and until when."""

    def __init__(self, replica: str, lease_s: float) -> None:
        self.replica = replica
        self.lease_s = lease_s
        self.epoch: int | None = None
        self.until = 0.0
        self.seen: tuple[str, int] = ("", 0)  # (leader, epoch) as the last cycle found them
        self._next_tick = 0.0
        metrics.SCHEDULER_LEADER.set(0)

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    def tick_due(self, now: float) -> bool:
        """Whether a cycle should run for the lease alone: the leader renews it, the others look whether it ran
        out, every third of the lease."""
        if now < self._next_tick:
            return False
        self._next_tick = now + self.lease_s / 3
        return True

    def decide(self, conn: Any, clock: ledger.Clock) -> tuple[int | None, float, bool]:
        """Under the clock row lock: (the epoch this cycle leads with or None, the lease's end, just acquired)."""
        me, lease, mine = self.replica, self.lease_s, self.epoch
        self.seen = (clock.leader, clock.epoch) if clock.until >= clock.now else ("", clock.epoch)
        if mine is not None:
            if clock.leader == me and clock.epoch == mine:
                # Renewed at every lease tick (a third of the lease; a cycle between ticks renews only past a sixth):
                # the leader keeps it through a stall of up to two thirds of the lease. Renewing only once less than
                # two thirds were left, as before, lost it to a stall of a third (0.5 s of a 1.5 s lease).
                if clock.until - clock.now >= lease * 5 / 6:
                    return mine, clock.until, False
                renewed = ledger.take_lease(conn, clock, me, lease, epoch=mine)
                if renewed is not None:
                    return mine, renewed.until, False
            # Deposed: another replica took the lease (ours ran out while we were stopped or cut off).
            self.epoch = None
            metrics.SCHEDULER_LEADER.set(0)
            metrics.FENCED.inc()
            metrics.LEADERSHIP_CHANGES.labels("lost").inc()
            log.warning(
                "leadership_lost",
                replica=me,
                epoch=mine,
                leader=clock.leader or None,
                leader_epoch=clock.epoch,
                note="the epoch check refused this replica's scheduling; it continues as a follower",
            )
            return None, 0.0, False
        if not clock.leader or clock.until < clock.now or clock.leader == me:
            taken = ledger.take_lease(conn, clock, me, lease, epoch=None)
            if taken is not None:
                return taken.epoch, taken.until, True
        return None, 0.0, False

    def committed(self, clock: ledger.Clock, epoch: int | None, until: float, acquired: bool) -> None:
        """The cycle that decided (epoch, until, acquired) committed: take it as this replica's lease."""
        if acquired:
            log.warning(
                "leadership_acquired",
                replica=self.replica,
                epoch=epoch,
                previous=clock.leader or None,
                previous_epoch=clock.epoch,
                lease_expired_s=round(max(0.0, clock.now - clock.until), 3) if clock.leader else None,
            )
            metrics.LEADERSHIP_CHANGES.labels("acquired").inc()
            self.seen = (self.replica, epoch or 0)
        self.epoch, self.until = epoch, until
        metrics.SCHEDULER_LEADER.set(1 if epoch is not None else 0)
        metrics.SCHEDULER_LEADER_EPOCH.set(self.seen[1])

    def release(self, conn: Any) -> None:
        """On a graceful stop, give the lease up so that another replica leads at once (a transaction on `conn`;
        on failure the lease simply runs out)."""
        if self.epoch is None:
            return
        try:
            with conn.begin():
                ledger.begin_cycle(conn)
                ledger.release_lease(conn, self.replica, self.epoch)
            log.info("leadership_released", replica=self.replica, epoch=self.epoch)
        except Exception as exc:  # the lease runs out by itself
            log.warning("leadership_release_failed", error=str(exc)[:200])
        self.epoch = None
        metrics.SCHEDULER_LEADER.set(0)
