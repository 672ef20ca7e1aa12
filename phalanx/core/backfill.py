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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .capacity import ClusterCapacity
from .model import GangRequest, Placement
from .placement import Unplaceable, _key, place_gang, queue_order
from .quota import DEFAULT_QUEUE, QuotaBook, Refusal, fair_order


@dataclass(frozen=True, slots=True)
class RunningEnd:
    """A running gang as planning sees it: what it holds and when it ends at the latest (inf: no time limit)."""

    job_id: str
    placement: Placement
    ends_at: float = math.inf


@dataclass(frozen=True, slots=True)
class Reservation:
    """The head's plan: it starts by `start` (inf: only once a gang without a time limit ends) on `placement`, and
    `nodes` (its whole lowest switch domains) take no gang that would outlive `start`."""

    job_id: str
    start: float
    nodes: frozenset[str]
    placement: Placement
    reason: str


@dataclass(frozen=True, slots=True)
class BackfillResult:
    placements: list[Placement]
    blocked: Unplaceable | None
    reservation: Reservation | None
    backfilled: tuple[str, ...]  # placed after the head, ahead of it in the queue
    flavors: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> quota flavor it was admitted under
    quota_blocked: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> why its quota refuses it


def _shape(r: GangRequest) -> tuple:
    """What placement depends on, besides the capacity: requests of one shape fit or not alike."""
    return (r.replicas, r.gpus_per_replica, r.gpu_model, r.mig_profile, r.gpu_milli, r.required_tier,
            r.preferred_tier)


def _release(cap: ClusterCapacity, gang: RunningEnd, unusable: Mapping[str, Collection[int]]) -> None:
    cap.release_placement(gang.placement)
    for node in gang.placement.nodes:
        held = unusable.get(node)
        if held:
            cap.take(node, held)


def _restore(cap: ClusterCapacity, gang: RunningEnd) -> None:
    for rep in gang.placement.replicas:
        if rep.mig_profile or rep.gpu_milli:
            cap.take_partial(rep)
        else:
            cap.take(rep.node, rep.gpus)


def region_of(capacity: ClusterCapacity, placement: Placement) -> frozenset[str]:
    """The whole lowest switch domains (level 1: NVLink domains or leaves) that `placement` touches; its nodes alone
    when the cluster has no fabric tiers, or when it sits on one node."""
    nodes = set(placement.nodes)
    if capacity.levels() <= 2 or len(nodes) <= 1:
        return frozenset(nodes)
    domains = {_key(capacity.nodes[n], 1) for n in nodes if n in capacity.nodes}
    return frozenset(n.name for d in domains for n in capacity.members(1, d))


def plan_reservation(
    capacity: ClusterCapacity, head: GangRequest, running: Sequence[RunningEnd], now: float,
    fabric_tiers: Sequence[str] = (), unusable: Mapping[str, Collection[int]] | None = None,
    ideal_cache: dict | None = None,
) -> Reservation | None:
    """When and where `head` can start at the earliest, as the running gangs end at their limits; None when it
    would not fit even with every running gang gone (then there is nothing to protect: lost or unhealthy capacity
    is in the way, and a reservation is planned again every cycle).

    Topology first: the placement must be as compact as the head's placement on an empty cluster (the same tier,
    no more domains), so it waits for whole leaves or NVLink domains rather than for scattered GPUs, and the
    region it keeps from long backfill is as small as the gang allows. Only when that can never happen (gangs
    without a time limit are in the way) does it take the earliest placement of any shape.
    """
    unusable = unusable or {}
    gangs = sorted(running, key=lambda g: (g.ends_at, g.job_id))
    rank = _tier_rank(capacity, fabric_tiers)
    # The head on an empty cluster (only down nodes and unusable GPUs out): it depends on the shape and on which
    # nodes are out, not on what runs, so it is worked out once per shape while they stay the same.
    down = frozenset(n.name for n in capacity.nodes.values() if not n.schedulable)
    key = (_shape(head), down, frozenset((n, frozenset(g)) for n, g in unusable.items()))
    best = ideal_cache.get(key) if ideal_cache is not None else None
    if best is None:
        empty = ClusterCapacity(
            dataclasses.replace(n, free=set(range(n.total)) - set(unusable.get(n.name, ())), mig={}, milli={})
            for n in capacity.nodes.values())
        ideal = place_gang(empty, head, fabric_tiers)
        best = (rank(ideal.tier), ideal.domains) if isinstance(ideal, Placement) else False
        if ideal_cache is not None:
            if len(ideal_cache) > 1000:
                ideal_cache.clear()
            ideal_cache[key] = best
    if best is False:
        return None

    def compact(p: Placement) -> bool:
        return (rank(p.tier), p.domains) <= best

    found = _earliest(capacity, head, gangs, fabric_tiers, unusable, compact)
    if found is None or (math.isinf(found[0]) and gangs and not math.isinf(gangs[0].ends_at)):
        anywhere = _earliest(capacity, head, gangs, fabric_tiers, unusable, lambda p: True)
        if anywhere is not None and (found is None or anywhere[0] < found[0]):
            found = anywhere
    if found is None:
        return None
    start, witness = found
    region = region_of(capacity, witness)
    when = "once a gang without a time limit ends" if math.isinf(start) else f"by t={start:.0f}"
    reason = (f"reserved to start {when} on {len(witness.nodes)} node(s) ({witness.reason}); gangs that would "
              f"outlive that are kept off its {len(region)} node(s)")
    return Reservation(head.job_id, max(start, now), region, witness, reason)


def _tier_rank(capacity: ClusterCapacity, fabric_tiers: Sequence[str]):
    from .placement import tier_names

    order = {name: i for i, name in enumerate(tier_names(capacity, fabric_tiers))}
    return lambda tier: order.get(tier, len(order))


def _earliest(capacity: ClusterCapacity, head: GangRequest, gangs: list[RunningEnd], fabric_tiers: Sequence[str],
              unusable: Mapping[str, Collection[int]], good) -> tuple[float, Placement] | None:
    """The earliest end (in `gangs`, sorted by end) after which `head` has a placement that is `good`, and that
    placement; None when not even with all of them gone. `good` must hold for every placement at least as free as
    one where it holds (releasing GPUs never makes the best placement worse), so a gallop and a binary search find
    it with O(log k) placements."""
    cap = capacity.copy()

    def fits() -> Placement | None:
        got = place_gang(cap, head, fabric_tiers)
        return got if isinstance(got, Placement) and good(got) else None

    released, size, lo = 0, 1, -1
    witness = fits()
    if witness is not None:
        return -math.inf, witness
    while True:  # gallop: release in end-time order, in prefixes of 1, 2, 4 ... until it fits
        target = min(size, len(gangs))
        while released < target:
            _release(cap, gangs[released], unusable)
            released += 1
        witness = fits()
        if witness is not None:
            hi = target
            break
        if target == len(gangs):
            return None
        lo, size = target, size * 2
    lo = max(lo, 0)
    while hi - lo > 1:  # binary search for the shortest prefix
        mid = (lo + hi) // 2
        while released > mid:
            released -= 1
            _restore(cap, gangs[released])
        while released < mid:
            _release(cap, gangs[released], unusable)
            released += 1
        got = fits()
        if got is not None:
            hi, witness = mid, got
        else:
            lo = mid
    return gangs[hi - 1].ends_at, witness


def schedule_with_backfill(
    capacity: ClusterCapacity,
    pending: Sequence[GangRequest],
    fabric_tiers: Sequence[str] = (),
    *,
    now: float = 0.0,
    running: Callable[[], Sequence[RunningEnd]] = tuple,
    unusable: Mapping[str, Collection[int]] | None = None,
    backfill: bool = True,
    memo: dict | None = None,
    book: QuotaBook | None = None,
    queues: Mapping[str, str] | None = None,
    depth: int | None = None,
) -> BackfillResult:
    """Serve `pending` in queue order, each gang all at once; the first that does not fit is the head and gets a
    reservation; later gangs backfill where they do not delay it. Reserves each placement in `capacity` as it
    goes. `running()` (called only when a head is blocked) lists the running gangs with their ends. With
    `backfill=False` the queue stops at the head (strict order). `memo`: a dict kept by the caller across calls;
    the head's reservation is planned again only when the head, the running gangs or the free GPUs changed.

    Quotas (`book`, with `queues`: job -> queue name): the order is fair (`quota.fair_order`); a gang its queue's
    quota refuses is passed over (it neither runs nor becomes the head: other queues go on); an admitted gang is
    placed under the first of its admissible flavors that has room, and charged to it.

    `depth`: look at no more than this many gangs behind the head (Slurm's bf_max_job_test): a long queue then
    costs a bounded pass; the rest wait for the next one."""
    placements: list[Placement] = []
    ends: dict[str, float] = {}
    head: Unplaceable | None = None
    reservation: Reservation | None = None
    backfilled: list[str] = []
    flavors: dict[str, str] = {}
    refused: dict[str, str] = {}
    failed: set[tuple] = set()  # (region hidden, shape) that did not fit behind the head in this pass
    if book is None:
        order: Iterable[tuple[str, GangRequest]] = (("", r) for r in queue_order(pending))
    else:
        # Lazy: fair_order asks the book for the queues' shares before each pick, after the charges so far.
        order = fair_order((((queues or {}).get(r.job_id, DEFAULT_QUEUE), r) for r in pending), book)
    for queue, request in order:
        if book is not None:
            admitted = book.admit(queue, request)
            if isinstance(admitted, Refusal):
                refused[request.job_id] = admitted.reason
                continue
            variants = [(a.flavor, a.request) for a in admitted]
        else:
            variants = [("", request)]
        limit_end = now + request.time_limit if request.time_limit > 0 else math.inf
        placed = None
        if head is None:
            first_failure = None
            for flavor, variant in variants:
                result = place_gang(capacity, variant, fabric_tiers)
                if isinstance(result, Placement):
                    placed = (flavor, variant, result)
                    break
                first_failure = first_failure or (variant, result)
            if placed is None:
                variant, head = first_failure
                if not backfill:
                    break
                # The gangs placed in this pass count as running, with their own limits.
                planned = [*running(), *(RunningEnd(p.job_id, p, ends[p.job_id]) for p in placements)]
                key = (variant, frozenset((g.job_id, g.ends_at) for g in planned), capacity.free_gpus(),
                       frozenset(n.name for n in capacity.nodes.values() if not n.schedulable))
                if memo is not None and memo.get("key") == key:
                    reservation = memo["reservation"]
                else:
                    reservation = plan_reservation(capacity, variant, planned, now, fabric_tiers, unusable,
                                                   memo.setdefault("ideal", {}) if memo is not None else None)
                    if memo is not None:
                        memo.update(key=key, reservation=reservation)
                continue
        else:
            hide = reservation is not None and (math.isinf(limit_end) or limit_end > reservation.start)
            # Capacity only shrinks during a pass: a shape that did not fit behind the head will not fit later in
            # it either, so the long tail of a queue of look-alike gangs costs a lookup each, not a placement.
            variants = [(f, v) for f, v in variants if (hide, _shape(v)) not in failed]
            if not variants:
                continue
            if depth is not None:
                depth -= 1
                if depth < 0:
                    break
            hidden = []
            if hide:
                hidden = [n for n in reservation.nodes if n in capacity.nodes and capacity.nodes[n].schedulable]
                for n in hidden:
                    capacity.set_schedulable(n, False)
            try:
                for flavor, variant in variants:
                    result = place_gang(capacity, variant, fabric_tiers)
                    if isinstance(result, Placement):
                        placed = (flavor, variant, result)
                        break
                    failed.add((hide, _shape(variant)))
            finally:
                for n in hidden:
                    capacity.set_schedulable(n, True)
            if placed is None:
                continue
            backfilled.append(request.job_id)
        flavor, variant, result = placed
        capacity.reserve(result)
        placements.append(result)
        ends[result.job_id] = limit_end
        if book is not None:
            book.charge(queue, flavor, variant)
            flavors[result.job_id] = flavor
    return BackfillResult(placements, head, reservation, tuple(backfilled), flavors, refused)

