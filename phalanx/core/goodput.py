"""Goodput accounting: where a job's GPU time went. Pure: no I/O.

Every launch of a gang is an attempt, from its reservation to its teardown. Its GPU time (GPUs x seconds) splits
into three parts, and the time the job waited for GPUs is a fourth:

- restart: from the reservation until every rank runs (launching, and for a restart its restore);
- productive: the work that was kept: up to the attempt's last committed checkpoint when it was torn down (a
  failure, a preemption, a cancel), all of it when it succeeded, all of it so far while it runs;
- rollback: the work after that last committed checkpoint, which the next attempt does again. It is measured from
  the committed step: `kept_until` is when that step was reached in this attempt (its checkpoint began). When the
  job's latest committed checkpoint is older than the attempt, the attempt kept nothing;
- waiting: the job's GPUs x the time it was queued (from submission, and from each requeue, to its next
  reservation; backoff included).

allocated = restart + productive + rollback, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

CATEGORIES = ("allocated", "productive", "rollback", "restart", "waiting")


@dataclass(frozen=True, slots=True)
class AttemptTimes:
    """One attempt. `running_at` None: its ranks never all ran (all of it was restart). `ended_at` None: running.
    `outcome` "SUCCEEDED" keeps all the work; any other end keeps work up to `kept_until` only."""

    attempt: int
    gpus: float
    reserved_at: float
    running_at: float | None = None
    ended_at: float | None = None
    outcome: str = ""
    kept_until: float | None = None


@dataclass(frozen=True, slots=True)
class Goodput:
    """GPU-seconds by category."""

    allocated: float = 0.0
    productive: float = 0.0
    rollback: float = 0.0
    restart: float = 0.0
    waiting: float = 0.0

    @property
    def ratio(self) -> float:
        """productive / allocated (1.0 when nothing was allocated yet)."""
        return self.productive / self.allocated if self.allocated > 0 else 1.0

    def __add__(self, other: Goodput) -> Goodput:
        return Goodput(  # spelled out: a sum over fields() costs several times as much, and reads add thousands
            self.allocated + other.allocated,
            self.productive + other.productive,
            self.rollback + other.rollback,
            self.restart + other.restart,
            self.waiting + other.waiting,
        )

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in CATEGORIES}


assert tuple(f.name for f in fields(Goodput)) == CATEGORIES  # __add__ spells every field out


def _check(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return value


def account_attempt(a: AttemptTimes, now: float) -> Goodput:
    """The allocated, restart, productive and rollback GPU-seconds of one attempt (no waiting)."""
    _check(a.gpus, "gpus")
    if a.gpus < 0:
        raise ValueError(f"attempt {a.attempt}: gpus must be >= 0, got {a.gpus}")
    start = _check(a.reserved_at, "reserved_at")
    end = max(start, _check(a.ended_at if a.ended_at is not None else now, "ended_at"))
    ready = end if a.running_at is None else min(max(a.running_at, start), end)
    work = end - ready
    if a.ended_at is None or a.outcome == "SUCCEEDED":
        kept = work
    elif a.kept_until is None:
        kept = 0.0
    else:
        kept = min(max(a.kept_until - ready, 0.0), work)
    g = a.gpus
    return Goodput(
        allocated=g * (end - start), productive=g * kept, rollback=g * (work - kept), restart=g * (ready - start)
    )


def account_job(
    submitted_at: float, gpus: float, attempts: Sequence[AttemptTimes], now: float, finished_at: float | None = None
) -> Goodput:
    """A job's goodput from its attempts in order. `gpus`: what it asks for (its waiting is charged at that);
    `finished_at`: when it ended for good (None while it is active: a queued job is still waiting at `now`)."""
    allocated = productive = rollback = restart = waiting = 0.0  # plain sums: a Goodput per step costs more
    queued_since = submitted_at
    previous = 0
    for a in attempts:
        if a.attempt <= previous:
            raise ValueError(f"attempts must be in increasing order; {a.attempt} follows {previous}")
        previous = a.attempt
        waiting += gpus * max(0.0, a.reserved_at - queued_since)
        g = account_attempt(a, now)
        allocated += g.allocated
        productive += g.productive
        rollback += g.rollback
        restart += g.restart
        if a.ended_at is None:
            return Goodput(allocated, productive, rollback, restart, waiting)
        queued_since = a.ended_at
    # Queued since the last teardown (or submission): until now, or until it ended for good (when its last attempt
    # ended it, that is the same moment: no waiting).
    end = finished_at if finished_at is not None else now
    waiting += gpus * max(0.0, end - queued_since)
    return Goodput(allocated, productive, rollback, restart, waiting)


def total(parts: Iterable[Goodput]) -> Goodput:
    out = Goodput()
    for part in parts:
        out += part
    return out
