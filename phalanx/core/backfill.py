"""EASY backfill with a topology-shaped reservation for the head of the queue. Pure: no I/O.

The queue is served in order (priority, then submission). The first gang that does not fit is the head. It gets a
reservation: the earliest time `start` at which it fits, assuming every running gang ends at its declared time
limit (`started_at + time_limit`; a gang without one never ends, as far as planning knows), and where it goes then.
The reservation holds a region, not a GPU count: the whole lowest switch domains (NVLink domains or leaves) of
that future placement, or its nodes alone on a cluster without a fabric.

Every gang after the head may start now (backfill) if it does not delay the head:
- anywhere outside the region; or
- inside the region only if it declared a time limit that ends by `start` (`now + time_limit <= start`).
A gang without a time limit never enters the region. So the region's GPUs the head needs are free at `start`: the
gangs holding them then were planned to end by it (and are stopped at their limits), and no backfilled gang outlives
it there.

Starvation bound. Time limits are enforced, so once a gang is the head, it starts by its reservation's `start`,
which is at most `now + L` where L is the longest time limit among the gangs running in its region (plus a
scheduling tick and the time to stop them); later arrivals of equal or lower priority cannot push it back. A head
that can only fit once a gang without a time limit ends gets `start = inf`: then gangs with a time limit may use the
region, and once the unlimited gang ends the head's start is bounded again as above. A higher-priority arrival
becomes the head instead (priorities are meant to win).

Cost: one copy of the capacity view and O(log k) placements (a gallop over the running gangs in end-time order,
then a binary search), only when a head is blocked; each backfill candidate costs one placement, with the region's
nodes hidden for the ones that may not enter it.

The reservation itself (`plan_reservation`, and the running gangs in end order it plans on) is planned in
phalanx.core.reservation; this module serves the queue around it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .capacity import ClusterCapacity
from .claims import ClaimShield, outside, with_claimed
from .model import GangRequest, Placement
from .placement import Unplaceable, domain_members, place_gang, queue_order
from .quota import DEFAULT_QUEUE, QuotaBook, Refusal, fair_order
from .reservation import (
    InEndOrder,
    Reservation,
    RunningEnd,
    RunningSet,
    Shape,
    plan_reservation,
    region_of,
    shape_of,
)

# The reservation's names stay importable from here, where callers have always found them.
__all__ = [
    "BackfillResult",
    "Reservation",
    "RunningEnd",
    "RunningSet",
    "plan_reservation",
    "region_of",
    "schedule_with_backfill",
]


@dataclass(frozen=True, slots=True)
class BackfillResult:
    placements: list[Placement]
    blocked: Unplaceable | None
    reservation: Reservation | None
    backfilled: tuple[str, ...]  # placed after the head, ahead of it in the queue
    flavors: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> quota flavor it was admitted under
    quota_blocked: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> why its quota refuses it


def _claim_window(
    capacity: ClusterCapacity,
    hidden: Sequence[str],
    shield: ClaimShield | None,
    job_id: str,
    head: GangRequest | None,
) -> list[tuple[str, set[int]]]:
    """A claimant behind a blocked head may still take its claim inside the head's hidden region: the head's
    reservation was planned without any other gang's claim (backfill.with_claimed), so taking it delays it in
    nothing. The claimed nodes of the region are shown with only their claimed GPUs free; returns
    (node, GPUs taken out) to put back after the placement (showing the node hidden again)."""
    if shield is None or head is None or not hidden:
        return []
    claim = shield.claims.get(job_id)
    if claim is None:
        return []
    claimed: dict[str, set[int]] = {}
    for rep in claim.replicas:
        claimed.setdefault(rep.node, set()).update(rep.gpus)
    window = []
    for name in hidden:
        if name in claimed:
            extra = capacity.nodes[name].free - claimed[name]
            capacity.set_schedulable(name, True)
            capacity.take(name, extra)
            window.append((name, extra))
    return window


# Below every gang's priority: the shield then shows a gang its own claim only.
_NO_PRIORITY = -(2**62)


def _within_claim(shield: ClaimShield | None, job_id: str, reservation: Reservation | None) -> bool:
    """The head's reservation lies wholly on GPUs its own claim holds: the claim hides them from every gang behind
    it already. (A reservation that reaches beyond the claim, as a big gang's may when capacity moved since the
    claim was made, needs its region kept as any head's does.)"""
    claim = shield.claims.get(job_id) if shield is not None else None
    if claim is None or reservation is None:
        return False
    claimed = {(r.node, g) for r in claim.replicas for g in r.gpus}
    return all((r.node, g) in claimed for r in reservation.placement.replicas for g in r.gpus)


def _head_reservation(
    capacity: ClusterCapacity,
    head: GangRequest,
    fabric_tiers: Sequence[str],
    now: float,
    running: Callable[[], Sequence[RunningEnd] | RunningSet],
    placements: Sequence[Placement],
    ends: Mapping[str, float],
    unusable: Mapping[str, Collection[int]] | None,
    memo: dict[str, Any] | None,
    shield: ClaimShield | None,
    releasing: Sequence[Placement],
) -> Reservation | None:
    """The blocked head's reservation (`plan_reservation`), or the memo's when nothing it depends on changed. Leaves
    the shield showing the head no other gang's claim."""
    # The gangs placed in this pass count as running, with their own limits.
    live = running()
    extra = [RunningEnd(p.job_id, p, ends[p.job_id]) for p in placements]
    # The reservation is planned without any other gang's claim, even one the head may use now:
    # that claimant starts there as soon as its GPUs are released, so a reservation on them would
    # only be pushed back (and holding the claimant off for a later start would starve it).
    hidden_claims = [c for c in shield.claims.values() if c.job != head.job_id] if shield else []
    if hidden_claims:
        assert shield is not None
        shield.for_job(head.job_id, _NO_PRIORITY)
    if releasing:
        coming = outside(releasing, hidden_claims)
        extra += [RunningEnd(p.job_id, p, now) for p in coming]
    planned: InEndOrder | list[RunningEnd]
    running_key: tuple[RunningSet, int, frozenset[tuple[str, float]]] | frozenset[tuple[str, float]]
    if isinstance(live, RunningSet):
        planned = InEndOrder(live, extra)
        running_key = (live, live.version, frozenset((g.job_id, g.ends_at) for g in extra))
    else:
        planned = [*live, *extra]
        running_key = frozenset((g.job_id, g.ends_at) for g in planned)
    key = (
        head,
        running_key,
        capacity.free_gpus(),
        capacity.unschedulable(),
        tuple(c.job for c in hidden_claims),
        # A GPU that fails while a gang holds it changes no free count, only what comes free
        frozenset((n, frozenset(g)) for n, g in unusable.items() if g) if unusable else None,
    )
    reservation: Reservation | None
    if memo is not None and memo.get("key") == key:
        reservation = memo["reservation"]
    else:
        reservation = plan_reservation(
            capacity,
            head,
            planned,
            now,
            fabric_tiers,
            with_claimed(unusable, hidden_claims),
            memo.setdefault("ideal", {}) if memo is not None else None,
            memo.setdefault("hints", {}) if memo is not None else None,
        )
        if memo is not None:
            memo.update(key=key, reservation=reservation)
    return reservation


def _hide_region(capacity: ClusterCapacity, reservation: Reservation) -> list[str]:
    """Hide the head's region from placement; returns the nodes hidden (to show again)."""
    # A node with nothing free (no whole GPU, no MIG slice or share) is invisible to placement, hidden or not, and
    # capacity only shrinks during a pass: only the others need hiding.
    nodes = capacity.nodes
    hidden = [
        n
        for n in reservation.nodes
        if n in nodes and nodes[n].schedulable and (nodes[n].free or nodes[n].mig or nodes[n].milli)
    ]
    for n in hidden:
        capacity.set_schedulable(n, False)
    return hidden


def _keep_claimed_quota(
    book: QuotaBook | None, shield: ClaimShield | None, pending: Sequence[GangRequest]
) -> dict[str, tuple[str, str, GangRequest]]:
    """Charge each pending claimant's demand to the queue its claim keeps quota under; returns what was charged, by
    job id (the pass takes it back at the claimant's turn, and at its end)."""
    kept: dict[str, tuple[str, str, GangRequest]] = {}
    if book is not None and shield:
        for request in pending:
            claim = shield.claims.get(request.job_id)
            if claim is not None and claim.queue:
                kept[request.job_id] = (claim.queue, claim.flavor, request)
                book.charge(claim.queue, claim.flavor, request)
    return kept


def _first_fit(
    capacity: ClusterCapacity, variants: Sequence[tuple[str, GangRequest]], fabric_tiers: Sequence[str]
) -> tuple[tuple[str, GangRequest, Placement] | None, tuple[str, GangRequest, Unplaceable] | None]:
    """The first of a gang's admitted (flavor, request) variants that fits, or the first failure."""
    first_failure: tuple[str, GangRequest, Unplaceable] | None = None
    for flavor, variant in variants:
        result = place_gang(capacity, variant, fabric_tiers)
        if isinstance(result, Placement):
            return (flavor, variant, result), None
        first_failure = first_failure or (flavor, variant, result)
    return None, first_failure


class _BehindHead:
    """The gangs behind a blocked head, in one pass: each placed only where it does not delay the head (EASY
    backfill), with the head's region hidden from those that would outlive its reservation, and the shapes that
    did not fit remembered (capacity only shrinks during a pass)."""

    def __init__(
        self,
        capacity: ClusterCapacity,
        fabric_tiers: Sequence[str],
        shield: ClaimShield | None,
        depth: int | None,
        deadline: float,
        head: GangRequest,
        reservation: Reservation | None,
        head_claims: bool,
    ) -> None:
        self.capacity, self.fabric_tiers, self.shield = capacity, fabric_tiers, shield
        self.depth, self.deadline = depth, deadline
        self.head, self.reservation, self.head_claims = head, reservation, head_claims
        self.failed: set[tuple[bool, Shape]] = set()  # (region hidden, shape) that did not fit behind the head
        self.hidden: list[str] = []  # the head's region, while hidden from the gangs that may not enter it
        self.hidden_region = False

    def show_region(self) -> None:
        for n in self.hidden:
            self.capacity.set_schedulable(n, True)
        self.hidden, self.hidden_region = [], False

    def turn(
        self, request: GangRequest, variants: list[tuple[str, GangRequest]], claimant: bool, limit_end: float
    ) -> tuple[bool, tuple[str, GangRequest, Placement] | None]:
        """Try one gang behind the head: (the pass stops here, what was placed: None when nothing was)."""
        capacity, reservation, failed = self.capacity, self.reservation, self.failed
        placed = None
        # Every gang looked at behind the head counts, tried or passed over: the pass ends after `depth` of
        # them however long the queue (Slurm's bf_max_job_test counts them the same way).
        if self.depth is not None:
            self.depth -= 1
            if self.depth < 0:
                return True, None
        # A head whose reservation lies in its claim needs no region kept for it: the claim already hides
        # what it will run on from every gang behind it (and a leaf-wide region would hold back other
        # claimants needlessly).
        hide = (
            reservation is not None
            and not self.head_claims
            and (math.isinf(limit_end) or limit_end > reservation.start)
        )
        # Capacity only shrinks during a pass: a shape that did not fit behind the head will not fit later
        # in it either, so the long tail of a queue of look-alike gangs costs a lookup each, not a placement.
        # (Not for a claimant: it sees its claim, which the gangs before it did not.)
        if not claimant:
            variants = [(f, v) for f, v in variants if (hide, shape_of(v)) not in failed]
            if not variants:
                return False, None
        if self.deadline < math.inf and time.perf_counter() > self.deadline:
            return True, None
        # The region is hidden while the gangs tried may not enter it; it stays hidden from one such gang
        # to the next (each placement sees what it would see were the region hidden and shown around it).
        if hide and not self.hidden_region:
            assert reservation is not None  # hide is only true with a reservation
            self.hidden, self.hidden_region = _hide_region(capacity, reservation), True
        elif not hide and self.hidden_region:
            self.show_region()
        window = _claim_window(capacity, self.hidden, self.shield, request.job_id, self.head) if claimant else []
        try:
            for flavor, variant in variants:
                result = place_gang(capacity, variant, self.fabric_tiers)
                if isinstance(result, Placement):
                    placed = (flavor, variant, result)
                    break
                if not claimant:
                    failed.add((hide, shape_of(variant)))
        finally:
            for n, shut in window:
                capacity.release(n, shut)
                capacity.set_schedulable(n, False)
        return False, placed


def _order(
    pending: Sequence[GangRequest], book: QuotaBook | None, queues: Mapping[str, str] | None
) -> Iterable[tuple[str, GangRequest]]:
    """(queue, gang) in the order a pass serves them: queue order, or the fair order across queues with quotas."""
    if book is None:
        return (("", r) for r in queue_order(pending))
    # Lazy: fair_order asks the book for the queues' shares before each pick, after the charges so far.
    return fair_order((((queues or {}).get(r.job_id, DEFAULT_QUEUE), r) for r in pending), book)


def _swap_kept(
    book: QuotaBook | None,
    kept: dict[str, tuple[str, str, GangRequest]],
    recharge: tuple[str, str, GangRequest] | None,
    job_id: str,
) -> tuple[str, str, GangRequest] | None:
    """At a gang's turn: the quota of the claimant tried before (not placed) is kept again for the rest of the
    pass, and this gang's own kept quota, if any, is given back for it to use; returns the latter (to recharge)."""
    if recharge is not None:  # it was not placed: its quota stays kept for the rest of the pass
        assert book is not None
        book.charge(*recharge)
        kept[recharge[2].job_id] = recharge
    mine = kept.pop(job_id, None)
    if mine is not None:
        assert book is not None
        book.charge(*mine, sign=-1)
    return mine


def _variants(book: QuotaBook | None, queue: str, request: GangRequest) -> list[tuple[str, GangRequest]] | Refusal:
    """The (flavor, request) a gang may be placed as: its admissions by its queue's quota, or why it refuses."""
    if book is None:
        return [("", request)]
    admitted = book.admit(queue, request)
    if isinstance(admitted, Refusal):
        return admitted
    return [(a.flavor, a.request) for a in admitted]


class _Spread:
    """A service's replicas placed in this pass, as the nodes of their domains: the service's next replicas keep off
    them where they fit elsewhere (GangRequest.spread_group)."""

    def __init__(self, capacity: ClusterCapacity, fabric_tiers: Sequence[str]) -> None:
        self.capacity, self.fabric_tiers = capacity, fabric_tiers
        self.seen: dict[str, frozenset[str]] = {}

    def apart(self, request: GangRequest) -> GangRequest:
        taken = self.seen.get(request.spread_group) if request.spread_group else None
        return replace(request, spread=request.spread | taken) if taken else request

    def placed(self, request: GangRequest, result: Placement) -> None:
        if request.spread_group and request.spread_tier:
            nodes = domain_members(self.capacity, result.nodes, request.spread_tier, self.fabric_tiers)
            self.seen[request.spread_group] = self.seen.get(request.spread_group, frozenset()) | nodes


def schedule_with_backfill(
    capacity: ClusterCapacity,
    pending: Sequence[GangRequest],
    fabric_tiers: Sequence[str] = (),
    *,
    now: float = 0.0,
    running: Callable[[], Sequence[RunningEnd] | RunningSet] = tuple,
    unusable: Mapping[str, Collection[int]] | None = None,
    backfill: bool = True,
    memo: dict[str, Any] | None = None,
    book: QuotaBook | None = None,
    queues: Mapping[str, str] | None = None,
    depth: int | None = None,
    budget_s: float = 0.0,
    shield: ClaimShield | None = None,
    releasing: Sequence[Placement] = (),
) -> BackfillResult:
    """Serve `pending` in queue order, each gang all at once; the first that does not fit is the head and gets a
    reservation; later gangs backfill where they do not delay it. Reserves each placement in `capacity` as it
    goes. `running()` (called only when a head is blocked) lists the running gangs with their ends. With
    `backfill=False` the queue stops at the head (strict order). `memo`: a dict kept by the caller across calls;
    the head's reservation is planned again only when the head, the running gangs or the free GPUs changed.

    Quotas (`book`, with `queues`: job -> queue name): the order is fair (`quota.fair_order`); a gang its queue's
    quota refuses is passed over (it neither runs nor becomes the head: other queues go on); an admitted gang is
    placed under the first of its admissible flavors that has room, and charged to it.

    `depth`: look at no more than this many gangs behind the head, whether tried or passed over for a shape that
    already failed (Slurm's bf_max_job_test): a long queue then costs a bounded pass; the rest wait for the next
    one. `budget_s` (> 0): stop trying gangs behind the head once the pass has taken this long (perf_counter; so
    only callers that accept a machine-dependent cut pass it).

    Claims (`shield`, phalanx.core.claims): before each gang is tried, the index shows it the claimed capacity it
    may use and hides the rest; a claimant placed ends its claim in the shield. `releasing`: GPUs of ended gangs
    that their nodes still hold until the processes are gone; the head's reservation counts them as coming free
    now (those of claims hidden from the head excepted)."""
    placements: list[Placement] = []
    ends: dict[str, float] = {}
    head: Unplaceable | None = None
    reservation: Reservation | None = None
    backfilled: list[str] = []
    flavors, refused = dict[str, str](), dict[str, str]()
    order = _order(pending, book, queues)
    deadline = time.perf_counter() + budget_s if budget_s > 0 else math.inf
    # A claimant's quota is kept for it as its GPUs are: its demand is charged to its queue until its turn (so no
    # gang served before it takes the quota it needs), and while it waits after it.
    kept = _keep_claimed_quota(book, shield, pending)
    recharge: tuple[str, str, GangRequest] | None = None  # the last claimant tried, until it is placed
    behind: _BehindHead | None = None  # the gangs behind the head, once there is one
    spread = _Spread(capacity, fabric_tiers)
    try:
        for queue, request in order:
            request = spread.apart(request)
            recharge = _swap_kept(book, kept, recharge, request.job_id)
            claimant = shield is not None and shield.owns(request.job_id)
            if shield:
                shield.for_request(request)
            variants = _variants(book, queue, request)
            if isinstance(variants, Refusal):
                refused[request.job_id] = variants.reason
                continue
            limit_end = now + request.time_limit if request.time_limit > 0 else math.inf
            placed = None
            if head is None:
                placed, first_failure = _first_fit(capacity, variants, fabric_tiers)
                if placed is None:
                    assert first_failure is not None  # every variant failed (book.admit never admits none)
                    head_flavor, variant, head = first_failure
                    if not backfill:
                        break
                    reservation = _head_reservation(
                        capacity,
                        variant,
                        fabric_tiers,
                        now,
                        running,
                        placements,
                        ends,
                        unusable,
                        memo,
                        shield,
                        releasing,
                    )
                    claims = _within_claim(shield, variant.job_id, reservation)
                    behind = _BehindHead(capacity, fabric_tiers, shield, depth, deadline, variant, reservation, claims)
                    if book is not None and recharge is None and reservation is not None:
                        # EASY backfill for quota too: a head that will fit keeps its demand charged to its queue for
                        # the rest of the pass (as a claimant does), so no gang behind it takes the quota it needs
                        # and leaves it, once its GPUs come free (or its victims stop), unable to start.
                        recharge = (queue, head_flavor, variant)
                    continue
            else:
                assert behind is not None  # set when the head was found
                stop, placed = behind.turn(request, variants, claimant, limit_end)
                if stop:
                    break
                if placed is None:
                    continue
                backfilled.append(request.job_id)
            flavor, variant, result = placed
            capacity.reserve(result)
            recharge = None
            if claimant:
                assert shield is not None
                shield.drop(request.job_id)
            placements.append(result)
            ends[result.job_id] = limit_end
            spread.placed(request, result)
            if book is not None:
                book.charge(queue, flavor, variant)
                flavors[result.job_id] = flavor
    finally:
        if behind is not None:
            behind.show_region()
        if shield:
            shield.restore()
        if book is not None:
            for keeps in kept.values():  # the pass is over: the book holds what runs, no more
                book.charge(*keeps, sign=-1)
    return BackfillResult(placements, head, reservation, tuple(backfilled), flavors, refused)
