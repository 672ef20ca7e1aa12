"""One pure scheduling decision: `decide(snapshot, now) -> Plan`. No I/O, no wall clock (only the budgets a config
may set), no logging.

The policy of a scheduling cycle lives here and only here; the scheduler's cycle (services/scheduler/cycle.py) and
the trace simulator (phalanx/sim/engine.py) both take a `Snapshot`, call `decide`, and apply the `Plan` their own
way (ledger writes and agent assignments; a virtual cluster and a virtual clock).

What one decision does, in order (numbered as `decide` runs them):
1. Victims. A running gang asked to checkpoint for a preemptor is stopped once its checkpoint is committed (its
   request is no longer outstanding) or its grace period is over (`Stop`); while it checkpoints, look again soon
   (`WakeAt`). A victim whose preemptor no longer waits (placed elsewhere, cancelled) keeps running (`CallOff`).
2. The handover. A preemptor whose victims were stopped in this decision is placed first, on the GPUs they freed
   (an atomic handover: a requeued victim that outranks it, by a quota reclaim, would otherwise take them back).
3. The pass. The pending queue, minus jobs in their retry backoff (`WakeAt` their end), is served in order
   (priority, then submission; fair order across queues with quotas) by `backfill.schedule_with_backfill`: each
   gang is placed whole or not at all (`Reserve`); a gang its quota refuses waits (`Wait`, QUOTA); the first that
   does not fit is the head and gets a reservation that shorter gangs may backfill around (EASY), except while a
   preemption is under way (its plan counts on the GPUs that are free now).
4. The blocked head. An extension point (`after_blocked`: the service's MIG mode switches) may make it wait;
   else preemption (`preemption.choose_victims`): lower-priority gangs (and, with quotas, gangs of the head's cohort
   running on borrowed quota: a reclaim) are asked to checkpoint (`AskCheckpoint`) by a deadline; with a zero grace
   period they are stopped at once and the pass runs once more (2-3 again). Otherwise it waits holding nothing
   (`Wait`, with why).

Ownership: `decide` plans on `snapshot.capacity` itself (a copy of a large cluster every cycle would cost more
than the pass): when it returns, the index holds the cluster as the plan leaves it (every `Reserve` reserved,
every `Stop` released). An applier writes the plan and does not touch the index again, except to give back a
`Reserve` it failed to apply (or to rebuild the index). `snapshot.memo` is the caller's cache across decisions:
the plan is the same with a fresh one.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from .backfill import BackfillResult, Reservation, RunningEnd, RunningSet, schedule_with_backfill
from .capacity import PLACEMENT_BUDGET_MS, ClusterCapacity
from .model import GangRequest, Placement
from .preemption import NoPreemption, PreemptionPolicy, RunningGang, choose_victims
from .quota import DEFAULT_QUEUE, QueueSpec, QuotaBook, usage_of
from .status import Code, Status

__all__ = [
    "AfterBlocked",
    "AskCheckpoint",
    "CallOff",
    "Code",
    "DecideConfig",
    "Memo",
    "PendingJob",
    "Plan",
    "Reserve",
    "RunningJob",
    "Snapshot",
    "Status",
    "Step",
    "Stop",
    "Wait",
    "WakeAt",
    "decide",
]


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
        """When its time limit ends it (inf: none), as backfill plans."""
        limit = self.request.time_limit
        return self.started_at + limit if limit else math.inf


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


# ---- the plan ----------------------------------------------------------------------------------------------------


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
    made way for (a preemption's handover)."""

    job: str
    reason: str
    by: str = ""


@dataclass(frozen=True, slots=True)
class CallOff:
    """A victim whose preemptor no longer waits keeps running; `reason` is its message."""

    job: str
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    job: str
    status: Status


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Decide again at `t` although nothing else happens (a backoff ending, a grace period, a protection)."""

    t: float


Step = Reserve | AskCheckpoint | Stop | CallOff | Wait | WakeAt
S = TypeVar("S", Reserve, AskCheckpoint, Stop, CallOff, Wait, WakeAt)


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


# The extension point after a pass whose head is blocked: (head id, the pass, the ids it served, backfill on) ->
# (the head's message while the extension holds it, None: it does not; a note for its usual message).
AfterBlocked = Callable[[str, BackfillResult, Sequence[str], bool], tuple[str | None, str]]


# ---- deciding ----------------------------------------------------------------------------------------------------


def decide(snapshot: Snapshot, now: float, *, after_blocked: AfterBlocked | None = None) -> Plan:
    """The plan for this moment: stop the victims whose time is up, place pending gangs in order (the handover
    first), and preempt for a blocked head when that would make it fit. See the module docstring."""
    d = _Decision(snapshot, now)
    d.stop_victims()  # 1
    for _ in range(2):  # a second pass only when a preemption with no grace period stopped victims at once
        pending = d.ready()
        if not pending:
            break
        backfill = d.config.backfill and not d.preempting
        first = [p for p in pending if p.request.job_id in d.handover_to] if d.handover_to else []  # 2
        d.handover_to.clear()
        if first:
            d.serve(first, backfill=False, memo=None, depth=None)
            pending = [p for p in pending if p.job_id not in d.reserved]
        book, result = d.serve(pending, backfill=backfill, memo=d.memo.reservation, depth=d.config.depth)  # 3
        if result.blocked is None:
            break
        head = d.pending[result.blocked.job_id]  # 4
        waits, note = None, ""
        if after_blocked is not None:
            waiting = [p.job_id for p in pending if p.job_id not in d.reserved]  # what still waits after the pass
            waits, note = after_blocked(head.job_id, result, waiting, backfill)
        stopped = False
        status: Status | None
        if waits is not None:
            status = Status(Code.EXTENSION, waits)
        else:
            status, stopped = d.preempt_for(head, book)
            status = status or Status(
                Code.UNSCHEDULABLE,
                f"waiting, holding no GPUs: {result.blocked.reason}" + reserved_note(result.reservation) + note,
            )
        d.steps.append(Wait(head.job_id, status))
        if not stopped:
            break
    return d.plan()


class _Decision:
    """One decision's working view: the running gangs and the pending queue as the steps so far leave them."""

    def __init__(self, snapshot: Snapshot, now: float) -> None:
        self.snap, self.now, self.config, self.memo = snapshot, now, snapshot.config, snapshot.memo
        self.cap = snapshot.capacity
        self.cap.placement_budget_ms = self.config.placement_budget_ms
        # The running gangs: the snapshot's, overlaid with this decision's changes (no copy of a large mapping).
        self.added: dict[str, RunningJob] = {}
        self.removed: set[str] = set()
        # Reserved in this decision, made RunningJobs only when something looks at the running gangs again.
        self.fresh: list[tuple[PendingJob, Placement, str]] = []
        self.pending = {p.request.job_id: p for p in snapshot.pending}
        self.preempting: set[str] = (
            set(snapshot.preempting)
            if snapshot.preempting is not None
            else {j for j, r in snapshot.running.items() if r.preempted_by}
        )
        self.steps: list[Step] = []
        self.wake = math.inf
        self.handover_to: set[str] = set()
        self.reserved: set[str] = set()
        self._order_cache: dict[str, int] | None = None
        self.releasing: list[Placement] = list(snapshot.releasing)  # plus what this decision's Stops hold

    # -- bookkeeping

    def wake_at(self, t: float) -> None:
        if t > self.now:
            self.wake = min(self.wake, t)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.fresh)

    def _settle(self) -> None:
        if self.fresh:
            for job, placement, flavor in self.fresh:
                self._set_running(
                    RunningJob(job.request, placement, self.now, job.queue, flavor, progress_since=self.now)
                )
            self.fresh.clear()

    def get(self, job_id: str) -> RunningJob:
        self._settle()
        job = self.added.get(job_id)
        return job if job is not None else self.snap.running[job_id]

    def running(self) -> Iterator[tuple[str, RunningJob]]:
        """(job id, gang) of every running gang as this decision leaves it, in the snapshot's order."""
        self._settle()
        added, removed = self.added, self.removed
        for j, r in self.snap.running.items():
            if j not in removed:
                yield j, added.get(j, r)
        for j, r in added.items():
            if j not in self.snap.running:
                yield j, r

    def _set_running(self, job: RunningJob) -> None:
        self.added[job.job_id] = job
        self.removed.discard(job.job_id)

    def _release(self, job: RunningJob) -> None:
        """Give `job`'s GPUs back in the index (the unusable ones on its nodes stay out, and its whole GPUs on nodes
        that hold them until their processes are gone)."""
        self.cap.release_placement(job.placement)
        unusable = self.snap.unusable
        if unusable:
            for node in job.placement.nodes:
                held = unusable.get(node)
                if held:
                    self.cap.take(node, held)
        if self.snap.hold_on_stop:
            kept = tuple(
                r
                for r in job.placement.replicas
                if r.node in self.snap.hold_on_stop and not (r.mig_profile or r.gpu_milli)
            )
            for r in kept:
                self.cap.take(r.node, set(r.gpus) - set(unusable.get(r.node, ()) if unusable else ()))
                if r.cpu_milli or r.memory:  # its processes still run there: their host resources stay held too
                    self.cap.take_use(r.node, r.cpu_milli, r.memory)
            if kept:
                self.releasing.append(Placement(job.job_id, kept, "", 0, 0.0, "releasing"))
        self.added.pop(job.job_id, None)
        self.removed.add(job.job_id)
        self.preempting.discard(job.job_id)

    def plan(self) -> Plan:
        if self.wake != math.inf:
            self.steps.append(WakeAt(self.wake))
        return Plan(tuple(self.steps))

    # -- 1. victims

    def stop_victims(self) -> bool:
        """Stop every victim whose checkpoint is committed or whose grace period is over; call off those whose
        preemptor no longer waits. True if any stopped."""
        stopped = False
        for vid in sorted(self.preempting, key=self._running_order):
            victim = self.get(vid)
            by = self.pending.get(victim.preempted_by)
            if by is None or by.job_id in self.reserved:
                self._set_running(_replace_victim(victim, "", 0.0))
                self.preempting.discard(vid)
                self.steps.append(
                    CallOff(
                        vid,
                        f"running; the preemption for job {victim.preempted_by} was called "
                        "off (that job no longer waits)",
                    )
                )
                continue
            p, q = by.request.priority, victim.request.priority
            why = (
                f"preempted by job {by.job_id} (priority {p} > {q})"
                if p > q
                else f"preempted by job {by.job_id}: its queue {by.queue!r} reclaims the quota queue "
                f"{victim.queue!r} borrowed"
            )
            if not victim.checkpoint_pending:
                reason = f"{why}: its checkpoint is committed"
            elif self.now >= victim.deadline:
                grace = self.config.preemption.grace_period_s if self.config.preemption else 0.0
                reason = f"{why}: stopped at the end of its {grace:g}s grace period without a new committed checkpoint"
            else:
                # The coordinator clears the request on commit without telling the scheduler: look again soon.
                self.wake_at(min(victim.deadline, self.now + self.config.poll_s))
                continue
            self._release(victim)
            self.pending[vid] = PendingJob(victim.request, victim.queue)  # requeued: served in this very pass
            self.steps.append(Stop(vid, reason, by=by.job_id))
            self.handover_to.add(by.job_id)
            stopped = True
        return stopped

    def _running_order(self, job_id: str) -> tuple[int, str]:
        if self._order_cache is None:  # the running gangs' order in the snapshot (the cycle's job order)
            self._order_cache = {j: i for i, j in enumerate(self.snap.running)}
        return (self._order_cache.get(job_id, len(self._order_cache)), job_id)

    # -- 2, 3. passes

    def ready(self) -> list[PendingJob]:
        """The pending queue without the jobs in their retry backoff (they neither run nor hold the queue)."""
        now, reserved = self.now, self.reserved
        out = [
            p for p in self.pending.values() if p.not_before <= now and not (reserved and p.request.job_id in reserved)
        ]
        if len(out) + len(reserved) < len(self.pending):  # some wait out a backoff: wake when it ends
            for p in self.pending.values():
                if p.not_before > now:
                    self.wake_at(p.not_before)
        return out

    def book(self) -> QuotaBook | None:
        """This pass's quota state: what each queue's running gangs use, per flavor (None: no queues)."""
        if not self.snap.queues:
            return None
        return QuotaBook(
            self.snap.queues, usage_of((r.queue, r.flavor, r.request) for _, r in self.running()), self.snap.totals
        )

    def _ends(self) -> Sequence[RunningEnd] | RunningSet:
        if not self.changed and self.snap.ends is not None:
            return self.snap.ends()
        return [RunningEnd(j, r.placement, r.ends_at) for j, r in self.running()]

    def serve(
        self, pending: Sequence[PendingJob], *, backfill: bool, memo: dict[str, Any] | None, depth: int | None
    ) -> tuple[QuotaBook | None, BackfillResult]:
        """One scheduling pass over `pending`: Reserve what it places, Wait for what its quota refuses."""
        book = self.book()
        result = schedule_with_backfill(
            self.cap,
            [p.request for p in pending],
            self.config.tiers,
            now=self.now,
            running=self._ends,
            unusable=self.snap.unusable,
            backfill=backfill,
            memo=memo,
            book=book,
            depth=depth,
            budget_s=self.config.backfill_budget_ms / 1000 if backfill else 0.0,
            queues={p.job_id: p.queue for p in pending} if book is not None else None,
        )
        for job_id, why in result.quota_blocked.items():
            self.steps.append(Wait(job_id, Status(Code.QUOTA, f"waiting for quota, holding no GPUs: {why}")))
        ahead = result.reservation.job_id if result.reservation is not None else ""
        backfilled = set(result.backfilled) if ahead else set()
        for placement in result.placements:
            job = self.pending[placement.job_id]
            flavor = result.flavors.get(job.job_id, "")
            self.steps.append(
                Reserve(job.job_id, placement, placement.reason, flavor, ahead if job.job_id in backfilled else "")
            )
            self.reserved.add(job.job_id)
            self.fresh.append((job, placement, flavor))
        return book, result

    # -- 4. preemption

    def preempt_for(self, head: PendingJob, book: QuotaBook | None) -> tuple[Status | None, bool]:
        """Start preempting for the blocked head when that would make it fit. Returns its status (None: the usual
        "waiting" one) and whether victims were stopped already (a zero grace period)."""
        policy = self.config.preemption
        if policy is None:
            return None, False
        now, hid, priority = self.now, head.job_id, head.request.priority
        mine = [v for v in map(self.get, self.preempting) if v.preempted_by == hid]
        if mine:
            until = max(v.deadline for v in mine)
            ids = ", ".join(v.job_id for v in sorted(mine, key=lambda v: self._running_order(v.job_id)))
            return Status(
                Code.PREEMPTING,
                f"waiting for {len(mine)} preempted gang(s) ({ids}) to checkpoint and "
                f"stop, by {clock(until)} at the latest; they hold the GPUs this gang "
                "gets",
            ), False
        # Reclaim (quotas): a head within its queue's nominal quota may also evict, whatever their priority, gangs
        # of other queues of its cohort that run on borrowed quota; they count as just below its priority. A head
        # that could run only on borrowed quota preempts within its own queue (Kueue's borrowWithinCohort "Never"):
        # else a reclaimed high-priority gang would evict its reclaimer, be reclaimed again, and so on.
        reclaim: set[str] = set()
        borrowing_head = False
        if book is not None:
            spec = book.spec(head.queue)
            admitted = book.admit(head.queue, head.request)
            flavors = [a.flavor for a in admitted if not a.borrowing] if isinstance(admitted, list) else []
            borrowing_head = isinstance(admitted, list) and bool(admitted) and not flavors
            if spec.cohort and flavors:
                reclaim = {
                    j
                    for j, r in self.running()
                    if j not in self.preempting
                    and r.queue != head.queue
                    and book.spec(r.queue).cohort == spec.cohort
                    and book.borrowing(r.queue, r.flavor)
                }
        own_queue_only = borrowing_head and not self.config.borrower_preempts
        lower: list[tuple[RunningJob, int]] = []
        for j, r in self.running():
            if j in self.preempting or (own_queue_only and r.queue != head.queue):
                continue
            if r.queue != head.queue and not head.by_admin and j not in reclaim:
                continue  # another queue's gang: only its borrowed quota may be taken back
            p = min(r.request.priority, priority - 1) if j in reclaim else r.request.priority
            if p < priority:
                lower.append((r, p))
        # GPUs being released count as the cheapest "victims" there are: evicting them costs nothing, they come
        # free by themselves.
        releasing = [
            RunningGang(f"{RELEASING}{i}:{p.job_id}", _RELEASING_PRIORITY, p, -math.inf, 0.0)
            for i, p in enumerate(self.releasing)
        ]
        if not lower and not releasing:
            return None, False
        # The answer only changes with the running set, the free GPUs or the clock passing a protection: a head
        # that stays blocked does not pay for the search every time.
        signature = (
            hid,
            priority,
            frozenset((r.job_id, r.attempt) for r, _ in lower),
            tuple(g.job_id for g in releasing),
            self.cap.free_gpus(),
            self.cap.unschedulable(),
        )
        memo = self.memo.no_preemption
        if memo is not None and memo[0] == signature and now < memo[1]:
            if memo[1] != math.inf:
                self.wake_at(memo[1])
            return memo[2], False
        saved = self.snap.saved_at
        gangs = []
        for r, p in lower:
            since = r.progress_since or r.started_at
            at = saved.get(r.job_id)
            if at is not None:
                since = max(since, at)
            gangs.append(RunningGang(r.job_id, p, r.placement, r.started_at, r.gpus * max(0.0, now - since)))
        result = choose_victims(
            self.cap, head.request, releasing + gangs, now, policy, self.config.tiers, self.snap.unusable
        )
        if not isinstance(result, NoPreemption) and all(v.startswith(RELEASING) for v in result.victims):
            held = sum(len(r.gpus) for g in releasing if g.job_id in result.victims for r in g.placement.replicas)
            of = sorted({g.job_id.split(":", 1)[1] for g in releasing if g.job_id in result.victims})
            self.wake_at(now + self.config.poll_s)
            return Status(
                Code.PREEMPTING,
                f"waiting for {held} GPU(s) that ended gang(s) {', '.join(of)} are releasing (their processes are "
                "exiting); then it fits",
            ), False
        if isinstance(result, NoPreemption):
            status = None
            until = math.inf
            if result.retry_in is not None:
                until = now + result.retry_in
                self.wake_at(until)
                status = Status(
                    Code.PROTECTED,
                    f"waiting, holding no GPUs: it could preempt lower-priority gangs "
                    f"once they pass their minimum runtime of {policy.min_runtime_s:g}s "
                    f"(at {clock(until)})",
                )
            self.memo.no_preemption = (signature, until, status)
            return status, False
        self.memo.no_preemption = None
        deadline = now + policy.grace_period_s
        request = f"preemption: job {hid} (priority {priority}) needs these GPUs"
        message = (
            f"preempting: job {hid} (priority {priority}) needs its GPUs; asked to checkpoint, stopped once "
            f"it is committed or by {clock(deadline)}"
        )
        for vid in result.victims:
            if vid.startswith(RELEASING):
                continue  # comes free by itself
            victim = self.get(vid)
            self.steps.append(
                AskCheckpoint(
                    vid, deadline, hid, request, message, reclaim=vid in reclaim and victim.request.priority >= priority
                )
            )
            self._set_running(_replace_victim(victim, hid, deadline))
            self.preempting.add(vid)
        self.wake_at(min(deadline, now + self.config.poll_s))
        stopped = policy.grace_period_s <= 0 and self.stop_victims()
        real = [v for v in result.victims if not v.startswith(RELEASING)]
        return Status(
            Code.PREEMPTING,
            f"preempting {len(real)} lower-priority gang(s) "
            f"({', '.join(real)}): they were asked to checkpoint and stop by "
            f"{clock(deadline)}; then {result.placement.reason}",
        ), stopped


RELEASING = "\x00releasing:"  # the job id prefix of GPUs being released, as preemption candidates
_RELEASING_PRIORITY = -(2**62)


def _replace_victim(job: RunningJob, by: str, deadline: float) -> RunningJob:
    return RunningJob(
        job.request,
        job.placement,
        job.started_at,
        job.queue,
        job.flavor,
        job.attempt,
        job.progress_since,
        job.gpus,
        by,
        deadline,
        True,
    )


def reserved_note(reservation: Reservation | None) -> str:
    """What the blocked head's message says about its reservation ("" none)."""
    if reservation is None:
        return ""
    if math.isinf(reservation.start):
        when = "once a running job without a time limit ends (none of those that could free its GPUs has one)"
    else:
        whose = f", when job {reservation.after}'s time limit ends" if reservation.after else ""
        when = f"by {clock(reservation.start)} at the latest{whose}"
    return (
        f". It is next in line and starts {when}, on {len(reservation.placement.nodes)} node(s); until then, only "
        f"jobs that end before it starts may run on the {len(reservation.nodes)} node(s) held for it (backfill)"
    )


def clock(ts: float) -> str:
    """A time as the messages show it (UTC, to the second); formats `ts`, reads no clock."""
    return _clock_at(int(ts))


@functools.lru_cache(maxsize=1024)
def _clock_at(second: int) -> str:
    # Cached: a blocked head's reservation keeps its start pass after pass (the replay runs thousands of passes).
    return time.strftime("%H:%M:%S", time.gmtime(second)) + " UTC"
