"""One pure scheduling decision: `decide(snapshot, now) -> Plan`. No I/O, no wall clock (only the budgets a config
may set), no logging.

The policy of a scheduling cycle lives here and only here; the scheduler's cycle (services/scheduler/cycle.py) and
the trace simulator (phalanx/sim/engine.py) both take a `Snapshot`, call `decide`, and apply the `Plan` their own
way (ledger writes and agent assignments; a virtual cluster and a virtual clock).

What one decision does, in order (numbered as `decide` runs them):
0. Claims (phalanx.core.claims). A preemptor holds a claim on the capacity its preemption planned for it, from the
   ask until it runs. Claims of gangs that no longer wait, or that can no longer fit where they claimed (a claimed
   node out, a claimed GPU unusable or in the other MIG mode), end here (`EndClaim`).
1. Victims. A running gang asked to checkpoint for a preemptor is stopped once its checkpoint is committed (its
   request is no longer outstanding) or its grace period is over (`Stop`); while it checkpoints, look again soon
   (`WakeAt`). A victim whose preemptor no longer waits (placed elsewhere, cancelled) keeps running (`CallOff`).
2. The handover, with claims off only (`DecideConfig.claims`): a preemptor whose victims were stopped in this
   decision is placed first, on the GPUs they freed. With claims it keeps its place in the queue: what it claimed
   is hidden from every gang that may not use it (equal or lower priority, its own victims), across decisions, as
   its victims' nodes confirm their releases one by one.
3. The pass. The pending queue, minus jobs in their retry backoff (`WakeAt` their end), is served in order
   (priority, then submission; fair order across queues with quotas) by `backfill.schedule_with_backfill`: each
   gang is placed whole or not at all (`Reserve`; a claimant placed ends its claim); a gang its quota refuses
   waits (`Wait`, QUOTA); the first that does not fit is the head and gets a reservation that shorter gangs may
   backfill around (EASY; GPUs still being released count as coming free now). Without claims, nothing is
   backfilled while a preemption is under way (its plan counts on the GPUs that are free now); with claims, the
   claims keep those GPUs and the pass goes on.
4. The blocked head. An extension point (`after_blocked`: the service's MIG mode switches) may make it wait;
   else preemption (`preemption.choose_victims`): lower-priority gangs (and, with quotas, gangs of the head's cohort
   running on borrowed quota: a reclaim) are asked to checkpoint (`AskCheckpoint`) by a deadline, and the head
   claims where it will go (`SetClaim`); with a zero grace period they are stopped at once and the pass runs again
   (2-4), as long as preemptions stop gangs. Otherwise it waits holding nothing (`Wait`, with why), and a claim
   that nothing would now make good ends.
5. Elastic gangs (phalanx.core.elastic). An elastic gang is placed at the most replicas that fit between its
   minimum and maximum; a running one below its maximum is asked to checkpoint for a grow when what is left fits
   it bigger, and is restarted at the bigger size (step 1, as its own victim) once that is committed.

The invariants every plan must keep, whatever the combination of these features, are written in
phalanx.core.invariants and checked on generated scenarios (tests/unit/test_scheduling_invariants.py,
bench/invariants.py).

Ownership: `decide` plans on `snapshot.capacity` itself (a copy of a large cluster every cycle would cost more
than the pass): when it returns, the index holds the cluster as the plan leaves it (every `Reserve` reserved,
every `Stop` released). An applier writes the plan and does not touch the index again, except to give back a
`Reserve` it failed to apply (or to rebuild the index). `snapshot.memo` is the caller's cache across decisions:
the plan is the same with a fresh one.

What a decision reads is in phalanx.core.snapshot, what it returns in phalanx.core.plan; both are re-exported here.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .backfill import BackfillResult, Reservation, RunningEnd, RunningSet, schedule_with_backfill
from .claims import Claim, ClaimShield, outside, with_claimed
from .elastic import finish_grow, kept_back, plan_grows, resizing, restarting
from .elastic_units import describe_minimum
from .model import Placement, ReplicaPlacement
from .plan import AskCheckpoint, CallOff, EndClaim, Plan, Reserve, SetClaim, Step, Stop, Wait, WakeAt
from .preemption import NoPreemption, Preemption, PreemptionPolicy, RunningGang, choose_victims, elastic_parts
from .quota import QuotaBook, demand, flavor_matches, usage_of
from .snapshot import DecideConfig, Memo, PendingJob, RunningJob, Snapshot
from .status import Code, Status

__all__ = [
    "AfterBlocked",
    "AskCheckpoint",
    "CallOff",
    "Claim",
    "Code",
    "DecideConfig",
    "EndClaim",
    "Memo",
    "PendingJob",
    "Plan",
    "Reserve",
    "RunningJob",
    "SetClaim",
    "Snapshot",
    "Status",
    "Step",
    "Stop",
    "Wait",
    "WakeAt",
    "decide",
]


# The extension point after a pass whose head is blocked: (head id, the pass, the ids it served, backfill on) ->
# (the head's message while the extension holds it, None: it does not; a note for its usual message).
AfterBlocked = Callable[[str, BackfillResult, Sequence[str], bool], tuple[str | None, str]]


# ---- deciding ----------------------------------------------------------------------------------------------------


def decide(snapshot: Snapshot, now: float, *, after_blocked: AfterBlocked | None = None) -> Plan:
    """The plan for this moment: stop the victims whose time is up, place pending gangs in order (the handover
    first), and preempt for a blocked head when that would make it fit. See the module docstring."""
    d = _Decision(snapshot, now)
    d.check_claims()  # 0
    d.stop_victims()  # 1
    # Another pass only when a preemption with no grace period stopped victims at once: its head is placed then,
    # and the next blocked head may preempt in turn (bounded: every such pass stops running gangs, of which there
    # are only so many).
    for _ in range(2 + len(d.pending)):
        pending = d.ready()
        if not pending:
            break
        # While a preemption is under way, its plan counts on GPUs that are free now: without claims nothing is
        # backfilled meanwhile; with claims, the preemptors' claims keep those GPUs, and the pass goes on.
        backfill = d.config.backfill and (d.shield.enabled or not d.preempting)
        # 2. Without claims, the handover: a preemptor whose victims were stopped in this decision first. With
        # claims it needs no turn of its own: its claim is hidden from every gang that may not take it, and it keeps
        # its place in the queue (a gang of higher priority, served before it, may still use it: priorities win).
        first = [p for p in pending if p.job_id in d.handover_to] if d.handover_to and not d.shield.enabled else []
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
        d.steps.append(Wait(head.job_id, status, result.reservation))
        if not stopped:
            break
    plan_grows(d)  # 5. elastic gangs below their maximum grow into what is left (phalanx.core.elastic)
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
        self.shield = ClaimShield(self.cap, snapshot.claims.values() if self.config.claims else (), self.config.claims)

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

    # -- 0. claims

    def check_claims(self) -> None:
        """End the claims of gangs that no longer wait, and of those that can no longer fit where they claimed (a
        claimed node is out, a claimed GPU unusable or in the other MIG mode)."""
        if not self.shield:
            return
        cap, unusable = self.cap, self.snap.unusable
        for claim in list(self.shield.claims.values()):
            why = ""
            if claim.job not in self.pending:
                why = "its job no longer waits"
            else:
                for rep in claim.replicas:
                    node = cap.nodes.get(rep.node)
                    if node is None or not node.schedulable:
                        why = f"node {rep.node}, which it claimed, is out of service"
                    elif set(rep.gpus) & set(unusable.get(rep.node, ())):
                        why = f"GPUs it claimed on {rep.node} are unusable"
                    elif any((g in node.mig_gpus) != bool(rep.mig_profile) for g in rep.gpus):
                        why = f"GPUs it claimed on {rep.node} changed MIG mode"
                    if why:
                        why += ": it no longer fits where it claimed"
                        break
            if why:
                self.end_claim(claim.job, why)

    def end_claim(self, job_id: str, reason: str) -> None:
        if self.shield.owns(job_id):
            self.shield.drop(job_id)
            self.steps.append(EndClaim(job_id, reason))

    def claim_note(self, job_id: str) -> str:
        """What a waiting claimant's message says of its claim ("" none)."""
        claim = self.shield.claims.get(job_id)
        if claim is None:
            return ""
        nodes = claim.nodes
        where = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
        return (
            f"; it holds a claim on the {claim.gpus} GPU(s) it gets and its victims free (on {where}), which no "
            "gang of lower priority may take meanwhile"
        )

    # -- 1. victims

    def stop_victims(self) -> bool:
        """Stop every victim whose checkpoint is committed or whose grace period is over; call off those whose
        preemptor no longer waits. True if any stopped."""
        stopped = False
        for vid in sorted(self.preempting, key=self._running_order):
            victim = self.get(vid)
            if resizing(victim):  # an elastic gang checkpointing for its own grow (phalanx.core.elastic)
                stopped = finish_grow(self, victim) or stopped
                continue
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
        if self.releasing and (waits := restarting(self)):  # elastic gangs waiting for their own GPUs' release
            out = [p for p in out if p.job_id not in waits]
            self.wake_at(now + self.config.poll_s)
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
        owned = set(self.shield.claims) if self.shield else ()
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
            shield=self.shield if self.shield else None,
            releasing=self.releasing if self.config.claims else (),
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
            if job.job_id in owned:  # (the pass dropped it from the shield when it placed the gang)
                self.steps.append(EndClaim(job.job_id, "it runs"))
        return book, result

    # -- 4. preemption

    def preempt_for(self, head: PendingJob, book: QuotaBook | None) -> tuple[Status | None, bool]:
        """Start preempting for the blocked head when that would make it fit. Returns its status (None: the usual
        "waiting" one) and whether victims were stopped already (a zero grace period). The head's claim follows:
        made (or widened) when victims are asked, kept while it waits for them, ended when nothing would make it
        fit now (it then waits like any blocked gang, with its backfill reservation)."""
        policy = self.config.preemption
        if policy is None:
            return None, False
        hid, priority = head.job_id, head.request.priority
        waiting = self._waiting_for_victims(head)
        if waiting is not None:
            return waiting, False
        lower, reclaim = self._lower(head, book)
        # GPUs being released count as the cheapest "victims" there are: evicting them costs nothing, they come
        # free by themselves (those of other gangs' claims this head may not use excepted).
        hidden = self.shield.hidden_from(hid, priority) if self.shield else []
        releasing = [
            RunningGang(p.job_id, _RELEASING_PRIORITY, p, -math.inf, 0.0, releasing=True)
            for p in (outside(self.releasing, hidden) if hidden else self.releasing)
        ]
        if not lower and not releasing:
            self.end_claim(hid, "nothing it could preempt or wait for makes it fit now; it waits as any blocked gang")
            return None, False
        self.shield.for_job(hid, priority)  # the index as this head may see it (other claims hidden)
        try:
            result = self._choose(head, lower, releasing, policy)
        finally:
            self.shield.restore()
        if result is None:  # the memo's answer
            return self.memo.no_preemption[2] if self.memo.no_preemption else None, False
        if isinstance(result, NoPreemption):
            return self._no_preemption(head, result, policy), False
        if not result.victims:  # only GPUs being released to wait for
            return self._wait_for_releasing(head, result), False
        self.memo.no_preemption = None
        return self._ask_victims(head, result, reclaim, book, policy)

    def _waiting_for_victims(self, head: PendingJob) -> Status | None:
        """The head's status while the victims it asked before still checkpoint (None: it has none)."""
        hid = head.job_id
        mine = [v for v in map(self.get, self.preempting) if v.preempted_by == hid]
        if not mine:
            return None
        until = max(v.deadline for v in mine)
        ids = ", ".join(v.job_id for v in sorted(mine, key=lambda v: self._running_order(v.job_id)))
        return Status(
            Code.PREEMPTING,
            f"waiting for {len(mine)} preempted gang(s) ({ids}) to checkpoint and "
            f"stop, by {clock(until)} at the latest; they hold the GPUs this gang "
            "gets" + self.claim_note(hid),
        )

    def _lower(self, head: PendingJob, book: QuotaBook | None) -> tuple[list[tuple[RunningJob, int]], set[str]]:
        """The running gangs the head may preempt, each with the priority it counts as, and those of them taken by
        a quota reclaim."""
        if not head.preempts:  # a rolling update's surge replica: it waits for a release, never evicts (LWS #717)
            return [], set()
        priority = head.request.priority
        # Reclaim (quotas): a head within its queue's nominal quota may also evict, whatever their priority, gangs
        # of other queues of its cohort that run on borrowed quota; they count as just below its priority. A head
        # that could run only on borrowed quota preempts within its own queue (Kueue's borrowWithinCohort "Never"):
        # else a reclaimed high-priority gang would evict its reclaimer, be reclaimed again, and so on.
        reclaim: set[str] = set()
        borrowed: set[str] = set()
        borrowing_head = False
        if book is not None:
            spec = book.spec(head.queue)
            admitted = book.admit(head.queue, head.request)
            flavors = [a.flavor for a in admitted if not a.borrowing] if isinstance(admitted, list) else []
            # Not within its nominal quota now: it would borrow, or (after this pass's charges) its quota even
            # refuses it. Either way it may preempt only within its own queue: taking another queue's GPUs by
            # priority to run on borrowed quota is what that queue then reclaims, in turn (a preemption cycle).
            borrowing_head = not flavors
            if spec.cohort and flavors:
                reclaim = self.reclaimable(head, book)
            elif spec.cohort and self.config.borrower_preempts:
                # borrowWithinCohort "LowerPriority": a borrowing head may evict lower-priority gangs of the other
                # queues, but only out of what they borrow (the walk of a reclaim): their nominal quota stays theirs.
                borrowed = self.reclaimable(head, book)
        own_queue_only = borrowing_head and not self.config.borrower_preempts
        lower: list[tuple[RunningJob, int]] = []
        for j, r in self.running():
            if j in self.preempting or (own_queue_only and r.queue != head.queue):
                continue
            if r.queue != head.queue and j not in reclaim and j not in borrowed:
                if not head.by_admin:
                    continue  # another queue's gang: only its borrowed quota may be taken back
                if book is not None and not book.spec(r.queue).unlimited:
                    # Its queue's nominal quota is a guarantee, to an admin's gang too: evicted by priority, it would
                    # take it back by a reclaim as soon as the preemptor's queue borrows (a preemption cycle).
                    continue
            p = min(r.request.priority, priority - 1) if j in reclaim else r.request.priority
            if p < priority:
                lower.append((r, p))
        return lower, reclaim

    def _wait_for_releasing(self, head: PendingJob, result: Preemption) -> Status:
        """The head fits once GPUs being released are gone, with no gang evicted: it waits for them."""
        hid, priority = head.job_id, head.request.priority
        held = sum(len(r.gpus) for g in result.waits_for for r in g.placement.replicas)
        of = sorted({_released_job(g.job_id) for g in result.waits_for})
        self.wake_at(self.now + self.config.poll_s)
        old = self.shield.claims.get(hid)
        if old is not None and not self.claim_intact(old):
            # A gang of higher priority took some of it: the claim moves to where it goes now, and keeps what of
            # the old one nothing else holds.
            self.set_claim(
                Claim.of(
                    hid,
                    priority,
                    result.placement,
                    old.victims,
                    old.since,
                    old.queue,
                    old.flavor,
                    freed=self.unheld(old),
                )
            )
        return Status(
            Code.PREEMPTING,
            f"waiting for {held} GPU(s) that ended gang(s) {', '.join(of)} are releasing (their processes are "
            "exiting); then it fits" + self.claim_note(hid),
        )

    def _no_preemption(self, head: PendingJob, result: NoPreemption, policy: PreemptionPolicy) -> Status | None:
        """No victims make the head fit: remember it (the memo), wake when protected gangs could, end its claim."""
        status = None
        until = math.inf
        if result.retry_in is not None:
            until = self.now + result.retry_in
            self.wake_at(until)
            status = Status(
                Code.PROTECTED,
                f"waiting, holding no GPUs: it could preempt lower-priority gangs "
                f"once they pass their minimum runtime of {policy.min_runtime_s:g}s "
                f"(at {clock(until)})",
            )
        self.memo.no_preemption = (self._signature, until, status)
        self.end_claim(
            head.job_id, "nothing it could preempt or wait for makes it fit now; it waits as any blocked gang"
        )
        return status

    def _ask_victims(
        self,
        head: PendingJob,
        result: Preemption,
        reclaim: set[str],
        book: QuotaBook | None,
        policy: PreemptionPolicy,
    ) -> tuple[Status, bool]:
        """Ask the victims to checkpoint by the grace period's end, and claim what they free for the head."""
        now, hid, priority = self.now, head.job_id, head.request.priority
        deadline = now + policy.grace_period_s
        request = f"preemption: job {hid} (priority {priority}) needs these GPUs"
        message = (
            f"preempting: job {hid} (priority {priority}) needs its GPUs; asked to checkpoint, stopped once "
            f"it is committed or by {clock(deadline)}"
        )
        real = list(result.victims)
        if self.config.claims:
            old = self.shield.claims.get(hid)
            # (an elastic victim stopped to shrink keeps its minimum's replicas: not claimed, it restarts on them)
            freed = [rep for v in real for rep in kept_back(self.get(v), v in result.shrunk)]
            if old is not None:  # widened: what it claimed before and nothing else holds stays claimed
                freed += self.unheld(old)
            self.set_claim(
                Claim.of(
                    hid,
                    priority,
                    result.placement,
                    (*(old.victims if old else ()), *real),
                    old.since if old else now,
                    *self.claim_quota(head, result.placement, book),
                    freed=freed,
                )
            )
        for vid in real:
            victim = self.get(vid)
            shrink = f"; it then restarts at its minimum of {describe_minimum(victim.request)} (elastic)"
            self.steps.append(
                AskCheckpoint(
                    vid,
                    deadline,
                    hid,
                    request,
                    message + (shrink if vid in result.shrunk else ""),
                    reclaim=vid in reclaim and victim.request.priority >= priority,
                )
            )
            self._set_running(_replace_victim(victim, hid, deadline))
            self.preempting.add(vid)
        self.wake_at(min(deadline, now + self.config.poll_s))
        stopped = policy.grace_period_s <= 0 and self.stop_victims()
        return Status(
            Code.PREEMPTING,
            f"preempting {len(real)} lower-priority gang(s) "
            f"({', '.join(real)}): they were asked to checkpoint and stop by "
            f"{clock(deadline)}; then {result.placement.reason}" + self.claim_note(hid),
        ), stopped

    _signature: Any = None

    def reclaimable(self, head: PendingJob, book: QuotaBook) -> set[str]:
        """The gangs a head within its nominal quota may take back from other queues of its cohort: a reclaim
        returns what was borrowed, no more. Per borrowing queue and flavor, its gangs in eviction order (lowest
        priority, then the latest started) while the queue still borrows before each: the one that ends its
        borrowing is the last (Kueue's reclaimWithinCohort walks its candidates the same way). A queue's gangs
        that its nominal quota covers stay out of reach, whatever their priority: evicting them would only make
        that queue reclaim in turn (a preemption cycle)."""
        cohort = book.spec(head.queue).cohort
        by_queue: dict[tuple[str, str], list[RunningJob]] = {}
        for j, r in self.running():
            if j in self.preempting or r.queue == head.queue or book.spec(r.queue).cohort != cohort:
                continue
            if book.borrowing(r.queue, r.flavor):
                by_queue.setdefault((r.queue, r.flavor), []).append(r)
        out: set[str] = set()
        for (queue, flavor), gangs in by_queue.items():
            quota = book.spec(queue).quotas.get(flavor)
            if quota is None:
                continue
            used_g, used_s = book.used(queue, flavor)
            over_g, over_s = used_g - quota.gpus, used_s - quota.mig_slices
            for r in sorted(gangs, key=lambda r: (r.request.priority, -r.started_at, r.job_id)):
                if over_g <= 1e-9 and over_s <= 1e-9:
                    break
                out.add(r.job_id)
                g, sl = demand(r.request)
                over_g, over_s = over_g - g, over_s - sl
        return out

    def _choose(
        self,
        head: PendingJob,
        lower: list[tuple[RunningJob, int]],
        releasing: list[RunningGang],
        policy: PreemptionPolicy,
    ) -> Preemption | NoPreemption | None:
        """`choose_victims` for the head on the index as it may see it; None when the memo already knows there are
        none (its answer is in `memo.no_preemption`)."""
        now, hid, priority = self.now, head.job_id, head.request.priority
        # The answer only changes with the running set, the free GPUs or the clock passing a protection: a head
        # that stays blocked does not pay for the search every time.
        self._signature = signature = (
            hid,
            priority,
            frozenset((r.job_id, r.attempt) for r, _ in lower),
            tuple(g.job_id for g in releasing),
            self.cap.free_gpus(),
            self.cap.unschedulable(),
            frozenset(self.shield.claims),
            frozenset((n, frozenset(g)) for n, g in self.snap.unusable.items() if g),
        )
        memo = self.memo.no_preemption
        if memo is not None and memo[0] == signature and now < memo[1]:
            if memo[1] != math.inf:
                self.wake_at(memo[1])
            self.end_claim(hid, "nothing it could preempt or wait for makes it fit now; it waits as any blocked gang")
            return None
        saved = self.snap.saved_at
        gangs = []
        for r, p in lower:
            since = r.progress_since or r.started_at
            at = saved.get(r.job_id)
            if at is not None:
                since = max(since, at)
            gang = RunningGang(r.job_id, p, r.placement, r.started_at, r.gpus * max(0.0, now - since))
            gangs += elastic_parts(gang, r.request) if r.request.elastic else [gang]
        # GPUs of claims this head may not use stay out even when the search releases their holders.
        unusable = with_claimed(self.snap.unusable, self.shield.hidden_from(hid, priority) if self.shield else ())
        return choose_victims(self.cap, head.request, releasing + gangs, now, policy, self.config.tiers, unusable)

    def unheld(self, claim: Claim) -> list[ReplicaPlacement]:
        """The replicas of `claim` whose GPUs no running gang holds but its own victims."""
        held = {
            (rep.node, g)
            for j, r in self.running()
            if j not in claim.victims
            for rep in r.placement.replicas
            for g in rep.gpus
        }
        out = []
        for rep in claim.replicas:
            if rep.mig_profile or rep.gpu_milli:
                if (rep.node, rep.gpus[0]) not in held:
                    out.append(rep)
                continue
            gpus = tuple(g for g in rep.gpus if (rep.node, g) not in held)
            if gpus:
                out.append(ReplicaPlacement(rep.replica, rep.node, gpus))
        return out

    def claim_intact(self, claim: Claim) -> bool:
        """Whether nothing but its own victims holds a whole GPU `claim` claims (a gang of higher priority may have
        taken some meanwhile): then the claimant keeps it, rather than move to other GPUs being released, which
        would hand the ones its victims freed to others and make it wait for more."""
        claimed = {(r.node, g) for r in claim.replicas if not (r.mig_profile or r.gpu_milli) for g in r.gpus}
        if not claimed:
            return True
        for j, r in self.running():
            if j in claim.victims:
                continue
            for rep in r.placement.replicas:
                if any((rep.node, g) in claimed for g in rep.gpus):
                    return False
        return True

    def claim_quota(self, head: PendingJob, placement: Placement, book: QuotaBook | None) -> tuple[str, str]:
        """(queue, flavor) a claim keeps quota under: the head's queue and the first of its flavors that matches
        the GPU model where it goes (("", "") without quotas)."""
        if book is None or book.spec(head.queue).unlimited:
            return "", ""
        node = self.cap.nodes.get(placement.replicas[0].node) if placement.replicas else None
        model = node.gpu_model if node is not None else ""
        flavor = next((f for f in book.spec(head.queue).quotas if flavor_matches(f, model)), "")
        return (head.queue, flavor) if flavor else ("", "")

    def set_claim(self, claim: Claim) -> None:
        self.shield.add(claim)
        self.steps.append(SetClaim(claim))


_RELEASING_PRIORITY = -(2**62)  # GPUs being released, as preemption candidates: below every gang


def _released_job(held_by: str) -> str:
    """The job whose GPUs are being released, from the id of their Placement: "<job>[/<attempt>]" -> "<job>"."""
    return held_by.split("/", 1)[0]


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
