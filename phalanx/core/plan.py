"""What one scheduling decision returns (`Plan`): its steps, in the order they must be applied (`Reserve`,
`AskCheckpoint`, `Stop`, `CallOff`, `SetClaim`, `EndClaim`, `Wait`, `WakeAt`). Plain data: the scheduler's cycle
writes them to the ledger and the agents, the trace simulator to its virtual cluster."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from .backfill import Reservation
from .claims import Claim
from .model import Placement
from .status import Status


@dataclass(frozen=True, slots=True)
class Reserve:
    """Reserve the whole gang on `placement` (already reserved in the snapshot's capacity). `flavor`: the quota
    flavor it is admitted under; `ahead_of`: the head it was backfilled in front of ("" none)."""

    job: str
    placement: Placement
    reason: str
    flavor: str = ""
    ahead_of: str = ""


@dataclass(frozen=True, slots=True)
class AskCheckpoint:
    """Ask a running gang to checkpoint; it is stopped once that commits or at `deadline`. `by`: the gang it makes
    way for; `request`: the reason given to the checkpoint coordinator; `message`: the victim's new message;
    `reclaim`: evicted for a quota reclaim (it does not have a lower priority than `by`)."""

    job: str
    deadline: float
    by: str = ""
    request: str = ""
    message: str = ""
    reclaim: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a gang (released in the snapshot's capacity) and requeue it; `reason` is its message, `by` the gang it
    made way for (a preemption's handover). `resize`: an elastic gang stopped to restart at another size
    (phalanx.core.elastic), neither preempted nor failed."""

    job: str
    reason: str
    by: str = ""
    resize: bool = False


@dataclass(frozen=True, slots=True)
class CallOff:
    """A victim whose preemptor no longer waits keeps running; `reason` is its message."""

    job: str
    reason: str


@dataclass(frozen=True, slots=True)
class SetClaim:
    """`claim.job` claims `claim.replicas` (it replaces the gang's claim, if any): made when its victims are asked
    to stop, kept until EndClaim."""

    claim: Claim


@dataclass(frozen=True, slots=True)
class EndClaim:
    """The claim of `job` ends: it runs, it left the queue, or it can no longer fit where it claimed."""

    job: str
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """`job` waits, holding nothing, for `status`. `reservation`: the blocked head's backfill reservation (None:
    none, or not the head)."""

    job: str
    status: Status
    reservation: Reservation | None = None


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Decide again at `t` although nothing else happens (a backoff ending, a grace period, a protection)."""

    t: float


Step = Reserve | AskCheckpoint | Stop | CallOff | SetClaim | EndClaim | Wait | WakeAt
S = TypeVar("S", Reserve, AskCheckpoint, Stop, CallOff, SetClaim, EndClaim, Wait, WakeAt)


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps, in the order they must be applied; at most one `WakeAt`, the last (the earliest time)."""

    steps: tuple[Step, ...] = ()

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def of(self, kind: type[S]) -> list[S]:
        """The steps of one kind, in order."""
        return [s for s in self.steps if isinstance(s, kind)]

    @property
    def wake_at(self) -> float:
        return next((s.t for s in self.steps if isinstance(s, WakeAt)), math.inf)
