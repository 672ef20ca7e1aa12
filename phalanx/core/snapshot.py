"""What one scheduling decision looks at (`Snapshot`): the pending queue (`PendingJob`), the running gangs
(`RunningJob`), the policy's settings (`DecideConfig`), the free capacity, quotas, claims and GPUs being released,
and the caller's cache across decisions (`Memo`). Plain data: `phalanx.core.decide` reads it, and the scheduler's
cycle and the trace simulator build it."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .backfill import RunningEnd, RunningSet
from .capacity import PLACEMENT_BUDGET_MS, ClusterCapacity
from .claims import Claim
from .model import GangRequest, Placement
from .preemption import PreemptionPolicy
from .quota import DEFAULT_QUEUE, QueueSpec
from .status import Status

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Mapping[str, Any]:
    return _EMPTY


# ---- the snapshot ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job of the pending queue: what it asks for, its queue, and when its retry backoff ends (0: none)."""

    request: GangRequest
    queue: str = DEFAULT_QUEUE
    not_before: float = 0.0
    # An admin submitted it (always so with authentication off): it may preempt other queues' gangs by priority.
    # Anyone else's job preempts only within its own queue, or to take back quota another queue borrowed.
    by_admin: bool = True
    # False: it never preempts (a rolling update's surge replica waits for an old replica's release instead of
    # evicting running work, the deadlock of LeaderWorkerSet issues 717 and 1050).
    preempts: bool = True

    @property
    def job_id(self) -> str:
        return self.request.job_id


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A running gang. `progress_since`: when the work that evicting it would lose began (the attempt's start, or
    when all its ranks ran); `snapshot.saved_at` may say its last committed checkpoint is later. `gpus`: the GPUs
    it holds, a partial GPU as its fraction. While it is a victim: `preempted_by` (the preemptor), `deadline` (when
    it is stopped at the latest) and `checkpoint_pending` (its checkpoint request is still outstanding)."""

    request: GangRequest
    placement: Placement
    started_at: float
    queue: str = DEFAULT_QUEUE
    flavor: str = ""
    attempt: int = 0
    progress_since: float = 0.0
    gpus: float = 0.0
    preempted_by: str = ""
    deadline: float = 0.0
    checkpoint_pending: bool = True

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def ends_at(self) -> float:
        """When it ends at the latest, as backfill plans: its time limit (inf: none), or a victim's deadline, when
        it is stopped whether its checkpoint committed or not (so a head's reservation sees the capacity its own or
        another preemptor's victims free, not only what time limits do)."""
        limit = self.request.time_limit
        end = self.started_at + limit if limit else math.inf
        return min(end, self.deadline) if self.preempted_by else end


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """When a running elastic gang grows. `grow_interval_s`: at most once per this many seconds (from the start of
    its attempt); `min_step` and `min_fraction`: by at least this many replicas and this fraction of its size (or
    to its maximum); `grace_period_s`: how long its checkpoint before the restart may take."""

    grow_interval_s: float = 300.0
    min_step: int = 1
    min_fraction: float = 0.25
    grace_period_s: float = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DecideConfig:
    """The policy's settings. `preemption` None: never preempt. `poll_s`: how soon to look again at a victim
    that is writing its checkpoint (the service is not told when it commits; inf: at its deadline only).
    `borrower_preempts`: a head that would run on borrowed quota may preempt other queues' lower-priority gangs too
    (off: only its own queue's, Kueue's borrowWithinCohort "Never"; the simulator's what-if).
    `placement_budget_ms`: the time budget of each placement's exact search (0: none; see placement.place_gang)."""

    tiers: tuple[str, ...] = ()
    backfill: bool = True
    depth: int | None = None
    preemption: PreemptionPolicy | None = None
    poll_s: float = math.inf
    borrower_preempts: bool = False
    placement_budget_ms: float = PLACEMENT_BUDGET_MS
    backfill_budget_ms: float = 0.0
    # A preemptor keeps what it freed (phalanx.core.claims). Off only to show what breaks without it: the
    # invariant checks' own test runs a decision with claims off and expects them to catch the inversion.
    claims: bool = True
    # Running elastic gangs grow towards their maximum (phalanx.core.elastic); None: they keep the size they
    # started (or restarted) at.
    elastic: ElasticPolicy | None = None


@dataclass
class Memo:
    """The caller's cache across decisions: the blocked head's reservation (`backfill.schedule_with_backfill`'s
    memo) and the last "no victims" answer, (signature, valid until, message)."""

    reservation: dict[str, Any] = field(default_factory=dict)
    no_preemption: tuple[Any, float, Status | None] | None = None


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """What one decision looks at.

    `capacity`: free capacity by domain (planned on in place: see the module docstring). `unusable`: GPUs per node
    that stay out of placement even when a gang releases them (FATAL ones, those switching MIG mode). `pending`:
    the pending queue. `running`: the running gangs by job id. `queues` and `totals`: the quotas (no queues: one
    unlimited queue, plain priority order) and the cluster's totals for their shares. `saved_at`: job id -> when its
    current attempt's last committed checkpoint was taken (read only for preemption candidates, so a caller may
    load it lazily). `ends`: optional, the running gangs in end order as the caller keeps them (a
    `backfill.RunningSet`), used while this decision has changed nothing that runs. `preempting`: optional, the ids
    of the running victims (else found in `running`). Not frozen only because a frozen dataclass costs a few
    microseconds more to build, every pass of a replay; `decide` never changes it (only the index it points to)."""

    capacity: ClusterCapacity
    pending: Sequence[PendingJob]
    running: Mapping[str, RunningJob]
    config: DecideConfig = DecideConfig()
    unusable: Mapping[str, Collection[int]] = field(default_factory=_empty)
    queues: Mapping[str, QueueSpec] = field(default_factory=_empty)
    totals: Mapping[str, float] = field(default_factory=_empty)
    saved_at: Mapping[str, float] = field(default_factory=_empty)
    ends: Callable[[], Sequence[RunningEnd] | RunningSet] | None = None
    preempting: Collection[str] | None = None
    memo: Memo = field(default_factory=Memo)
    # Clean GPU handover (the scheduler's agents that confirm releases): a stopped gang's whole GPUs on these nodes
    # stay taken until the node's agent says the gang's processes there are gone; `releasing` lists the GPUs
    # already waiting for that (Placements of ended attempts). Preemption counts them as coming free: a head they
    # would make fit waits for them rather than evicting more gangs.
    hold_on_stop: Collection[str] = ()
    releasing: Sequence[Placement] = ()
    # The preemptors' claims on the capacity their victims free, by preemptor (phalanx.core.claims): kept by the
    # caller from the plans' SetClaim and EndClaim steps.
    claims: Mapping[str, Claim] = field(default_factory=_empty)
    # Optional: the ids of the running elastic gangs below their maximum (else found in `running`), the only ones
    # that may grow (phalanx.core.elastic).
    elastic: Collection[str] | None = None
