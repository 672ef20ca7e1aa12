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
import heapq
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .capacity import ClusterCapacity
from .claims import ClaimShield, outside, with_claimed
from .model import GangRequest, Placement
from .placement import Unplaceable, domain_of, place_gang, queue_order, tier_names
from .quota import DEFAULT_QUEUE, QuotaBook, Refusal, fair_order


@dataclass(frozen=True, slots=True)
class RunningEnd:
    """A running gang as planning sees it: what it holds and when it ends at the latest (inf: no time limit)."""

    job_id: str
    placement: Placement
    ends_at: float = math.inf


def _end_key(gang: RunningEnd) -> tuple[float, str]:
    return gang.ends_at, gang.job_id


class RunningSet:
    """The running gangs in end order (`ends_at`, then job id), kept as they start and stop: for a caller that runs
    pass after pass over thousands of running gangs (the simulator). `schedule_with_backfill`'s `running` may return
    one; then a pass with a blocked head neither lists nor sorts the running gangs, and its memo compares `version`
    (bumped by every change) instead of every gang. The plans are the same as with a plain list of the same gangs."""

    __slots__ = ("_keys", "_gangs", "_at", "version")

    def __init__(self, gangs: Iterable[RunningEnd] = ()) -> None:
        self._keys: list[tuple[float, str]] = []
        self._gangs: list[RunningEnd] = []
        self._at: dict[str, tuple[float, str]] = {}
        self.version = 0
        for gang in gangs:
            self.add(gang)

    def add(self, gang: RunningEnd) -> None:
        self.discard(gang.job_id)
        key = _end_key(gang)
        i = bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._gangs.insert(i, gang)
        self._at[gang.job_id] = key
        self.version += 1

    def discard(self, job_id: str) -> None:
        key = self._at.pop(job_id, None)
        if key is None:
            return
        i = bisect_left(self._keys, key)
        del self._keys[i]
        del self._gangs[i]
        self.version += 1

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._at

    def __len__(self) -> int:
        return len(self._gangs)

    def __iter__(self) -> Iterator[RunningEnd]:
        return iter(self._gangs)

    def __getitem__(self, i: int) -> RunningEnd:
        return self._gangs[i]


class _InEndOrder:
    """Running gangs already in end order (a RunningSet) merged with a few more (sorted here), read lazily: the
    reservation's gallop looks only at a prefix."""

    __slots__ = ("_done", "_rest", "_len")

    def __init__(self, live: RunningSet, extra: Sequence[RunningEnd] = ()) -> None:
        self._len = len(live) + len(extra)
        if extra:
            self._done: list[RunningEnd] = []
            self._rest: Iterator[RunningEnd] | None = heapq.merge(live, sorted(extra, key=_end_key), key=_end_key)
        else:
            self._done, self._rest = live._gangs, None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __getitem__(self, i: int) -> RunningEnd:
        if i < 0:
            i += self._len
        done = self._done
        while self._rest is not None and len(done) <= i:
            done.append(next(self._rest))
        return done[i]


class _EndOrdered(Protocol):
    """Running gangs in end order, read by index: a sorted list or an `_InEndOrder` (what the search reads)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> RunningEnd: ...


# What placement depends on besides the capacity (`_shape`), and what `plan_reservation` remembers per head shape
# and set of nodes out (`ideal_cache`): the head's (tier rank, domains) on an empty cluster, False when it never fits.
_Shape = tuple[int, int, str, str, int, str, str, int, int]
_IdealKey = tuple[_Shape, frozenset[str], frozenset[tuple[str, frozenset[int]]]]
_Ideal = tuple[int, int] | Literal[False]


@dataclass(frozen=True, slots=True)
class Reservation:
    """The head's plan: it starts by `start` (inf: only once a gang without a time limit ends) on `placement`, and
    `nodes` (its whole lowest switch domains) take no gang that would outlive `start`."""

    job_id: str
    start: float
    nodes: frozenset[str]
    placement: Placement
    reason: str
    after: str = ""  # the running gang whose end (its time limit) is `start` ("": it fits now or never by limits)


@dataclass(frozen=True, slots=True)
class BackfillResult:
    placements: list[Placement]
    blocked: Unplaceable | None
    reservation: Reservation | None
    backfilled: tuple[str, ...]  # placed after the head, ahead of it in the queue
    flavors: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> quota flavor it was admitted under
    quota_blocked: Mapping[str, str] = dataclasses.field(default_factory=dict)  # job -> why its quota refuses it


def _shape(r: GangRequest) -> _Shape:
    """What placement depends on, besides the capacity: requests of one shape fit or not alike."""
    return r.shape


def _release(cap: ClusterCapacity, gang: RunningEnd, unusable: Mapping[str, Collection[int]]) -> None:
    cap.release_placement(gang.placement)
    if not unusable:
        return
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
        if rep.cpu_milli or rep.memory:
            cap.take_use(rep.node, rep.cpu_milli, rep.memory)


def region_of(capacity: ClusterCapacity, placement: Placement) -> frozenset[str]:
    """The whole lowest switch domains (level 1: NVLink domains or leaves) that `placement` touches; its nodes alone
    when the cluster has no fabric tiers, or when it sits on one node."""
    nodes = set(placement.nodes)
    if capacity.levels() <= 2 or len(nodes) <= 1:
        return frozenset(nodes)
    domains = {domain_of(capacity.nodes[n], 1) for n in nodes if n in capacity.nodes}
    return frozenset(n.name for d in domains for n in capacity.members(1, d))


def plan_reservation(
    capacity: ClusterCapacity,
    head: GangRequest,
    running: Sequence[RunningEnd] | RunningSet | _InEndOrder,
    now: float,
    fabric_tiers: Sequence[str] = (),
    unusable: Mapping[str, Collection[int]] | None = None,
    ideal_cache: dict[_IdealKey, _Ideal] | None = None,
    hints: dict[Any, int] | None = None,
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
    if isinstance(running, RunningSet):
        running = _InEndOrder(running)
    gangs: _EndOrdered = running if isinstance(running, _InEndOrder) else sorted(running, key=_end_key)
    rank = _tier_rank(capacity, fabric_tiers)
    # The head on an empty cluster (only down nodes and unusable GPUs out): it depends on the shape and on which
    # nodes are out, not on what runs, so it is worked out once per shape while they stay the same.
    down = capacity.unschedulable()
    key: _IdealKey = (_shape(head), down, frozenset((n, frozenset(g)) for n, g in unusable.items()))
    best: _Ideal | None = ideal_cache.get(key) if ideal_cache is not None else None
    if best is None:
        empty = ClusterCapacity(
            dataclasses.replace(
                n, free=set(range(n.total)) - set(unusable.get(n.name, ())), mig={}, milli={}, cpu_used=0, memory_used=0
            )
            for n in capacity.nodes.values()
        )
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

    if hints is not None and len(hints) > 1000:
        hints.clear()
    found = _earliest(capacity, head, gangs, fabric_tiers, unusable, compact, hints, (head.job_id, "compact"))
    if found is None or (math.isinf(found[0]) and gangs and not math.isinf(gangs[0].ends_at)):
        anywhere = _earliest(
            capacity, head, gangs, fabric_tiers, unusable, lambda p: True, hints, (head.job_id, "anywhere")
        )
        if anywhere is not None and (found is None or anywhere[0] < found[0]):
            found = anywhere
    if found is None:
        return None
    start, witness, after = found
    region = region_of(capacity, witness)
    when = "once a gang without a time limit ends" if math.isinf(start) else f"by t={start:.0f}"
    reason = (
        f"reserved to start {when} on {len(witness.nodes)} node(s) ({witness.reason}); gangs that would "
        f"outlive that are kept off its {len(region)} node(s)"
    )
    return Reservation(head.job_id, max(start, now), region, witness, reason, after)


def _tier_rank(capacity: ClusterCapacity, fabric_tiers: Sequence[str]) -> Callable[[str], int]:
    order = {name: i for i, name in enumerate(tier_names(capacity, fabric_tiers))}
    return lambda tier: order.get(tier, len(order))


def _earliest(
    capacity: ClusterCapacity,
    head: GangRequest,
    gangs: _EndOrdered,
    fabric_tiers: Sequence[str],
    unusable: Mapping[str, Collection[int]],
    good: Callable[[Placement], bool],
    hints: dict[Any, int] | None = None,
    hint_key: Any = None,
) -> tuple[float, Placement, str] | None:
    """The earliest end (in `gangs`, sorted by end) after which `head` has a placement that is `good`, that
    placement, and the gang whose end that is ("" when it fits with none gone); None when not even with all of
    them gone. `good` must hold for every placement at least as free as one where it holds (releasing GPUs never
    makes the best placement worse), so a gallop and a binary search find it with O(log k) placements (`hints`:
    from where the last one ended, usually a probe or two).

    The search releases and restores gangs on `capacity` itself and puts back every node it touched exactly as it
    was (free GPUs, partial use, index) before it returns: O(what it releases), not a copy of the cluster. A head
    asking for part of a GPU searches on a copy (the partial-GPU index would be rebuilt in another order)."""
    if head.partial:
        return _search(capacity.copy(), head, gangs, fabric_tiers, unusable, good, hints=hints, hint_key=hint_key)
    saved: dict[str, tuple[set[int], dict[int, int], dict[int, int], tuple[int, int]]] = {}
    stale: set[str] = set()
    try:
        return _search(capacity, head, gangs, fabric_tiers, unusable, good, saved, stale, hints, hint_key)
    finally:  # every node touched, back as it was, and the index with it
        for name, (free, mig, milli, use) in saved.items():
            node = capacity.nodes[name]
            node.cpu_used, node.memory_used = use  # not indexed
            changed = name in stale  # changed since the index last followed it
            if node.free != free:
                node.free -= node.free - free
                node.free |= free
                changed = True
            if node.mig != mig or list(node.mig) != list(mig):
                node.mig.clear()
                node.mig.update(mig)
                changed = True
            if node.milli != milli or list(node.milli) != list(milli):
                node.milli.clear()
                node.milli.update(milli)
                changed = True
            if changed:
                capacity._touch(node)


def _batched_moves(
    cap: ClusterCapacity,
    unusable: Mapping[str, Collection[int]],
    saved: dict[str, tuple[set[int], dict[int, int], dict[int, int], tuple[int, int]]],
    stale: set[str],
) -> tuple[Callable[[RunningEnd], None], Callable[[RunningEnd], None]]:
    """`_search`'s release and restore of a gang when it keeps `saved`: whole GPUs go back to and leave the nodes'
    free sets at once, each node's state saved before its first change, and the nodes changed are added to `stale`
    (the index follows them once per node before the next placement)."""
    nodes = cap.nodes

    def release(gang: RunningEnd) -> None:
        for rep in gang.placement.replicas:
            name = rep.node
            n = nodes.get(name)
            if n is None:
                continue
            if name not in saved:
                saved[name] = (set(n.free), dict(n.mig), dict(n.milli), (n.cpu_used, n.memory_used))
            if rep.cpu_milli or rep.memory:
                cap.release_use(name, rep.cpu_milli, rep.memory)
            if rep.mig_profile or rep.gpu_milli:
                cap.release_partial(rep)
            elif n.mig or n.milli:
                n.free |= {g for g in rep.gpus if 0 <= g < n.total and g not in n.mig and g not in n.milli}
                stale.add(name)
            else:
                n.free |= {g for g in rep.gpus if 0 <= g < n.total}
                stale.add(name)
        if unusable:
            for name in gang.placement.nodes:
                held = unusable.get(name)
                if held and name in nodes:
                    nodes[name].free -= set(held)
                    stale.add(name)

    def restore(gang: RunningEnd) -> None:
        for rep in gang.placement.replicas:
            if rep.cpu_milli or rep.memory:
                cap.take_use(rep.node, rep.cpu_milli, rep.memory)
            if rep.mig_profile or rep.gpu_milli:
                cap.take_partial(rep)
            elif rep.node in nodes:
                nodes[rep.node].free -= set(rep.gpus)
                stale.add(rep.node)

    return release, restore


def _search(
    cap: ClusterCapacity,
    head: GangRequest,
    gangs: _EndOrdered,
    fabric_tiers: Sequence[str],
    unusable: Mapping[str, Collection[int]],
    good: Callable[[Placement], bool],
    saved: dict[str, tuple[set[int], dict[int, int], dict[int, int], tuple[int, int]]] | None = None,
    stale: set[str] | None = None,
    hints: dict[Any, int] | None = None,
    hint_key: Any = None,
) -> tuple[float, Placement, str] | None:
    """`_earliest` on `cap`, changing it; `saved` (when given) gets each node's state before its first change.
    `hints[hint_key]`: the answer (a prefix length) of the last search of this kind, where this one starts; it
    gets this one's. The answer is the same from any start: fitting is monotone in the prefix.

    With `saved`, whole GPUs are released and taken back on the nodes' free sets at once (as `_release` and
    `_restore` do) and the index follows once per node before each placement, not once per replica: the index is a
    function of the free sets, so it reads the same. `stale` gets the nodes changed since the index last followed."""
    if stale is None:
        stale = set()
    if saved is not None:
        release, restore = _batched_moves(cap, unusable, saved, stale)
    else:

        def release(gang: RunningEnd) -> None:
            _release(cap, gang, unusable)

        def restore(gang: RunningEnd) -> None:
            _restore(cap, gang)

    def fits() -> Placement | None:
        if stale:
            for name in stale:
                cap._touch(cap.nodes[name])
            stale.clear()
        got = place_gang(cap, head, fabric_tiers)
        return got if isinstance(got, Placement) and good(got) else None

    released = 0

    def probe(prefix: int) -> Placement | None:
        """Whether the head fits once the first `prefix` gangs (in end order) are gone."""
        nonlocal released
        while released > prefix:
            released -= 1
            restore(gangs[released])
        while released < prefix:
            release(gangs[released])
            released += 1
        return fits()

    # The shortest prefix after which it fits: a gallop from `start` (0, or the answer of the cycle before: the
    # gangs change little from one cycle to the next, so it is a probe or two away), then a binary search between
    # the longest prefix known not to fit (lo) and the shortest known to fit (hi).
    count = len(gangs)
    hint = hints.get(hint_key) if hints is not None else None
    start = hint if hint is not None and 0 < hint <= count else 0
    lo, hi = -1, -1
    witness = probe(start)
    if witness is not None:
        hi, step = start, 1
        while hi > 0:  # down, in steps of 1, 2, 4 ... while it still fits
            prefix = max(hi - step, 0)
            got = probe(prefix)
            if got is None:
                lo = prefix
                break
            hi, witness, step = prefix, got, step * 2
    else:
        lo, step = start, 1
        while True:  # up, in steps of 1, 2, 4 ... until it fits
            if lo >= count:
                return None
            prefix = min(lo + step, count)
            got = probe(prefix)
            if got is not None:
                hi, witness = prefix, got
                break
            lo, step = prefix, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = probe(mid)
        if got is not None:
            hi, witness = mid, got
        else:
            lo = mid
    if hints is not None:
        hints[hint_key] = hi
    return (-math.inf if hi == 0 else gangs[hi - 1].ends_at), witness, ("" if hi == 0 else gangs[hi - 1].job_id)


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
    planned: _InEndOrder | list[RunningEnd]
    running_key: tuple[RunningSet, int, frozenset[tuple[str, float]]] | frozenset[tuple[str, float]]
    if isinstance(live, RunningSet):
        planned = _InEndOrder(live, extra)
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
        self.failed: set[tuple[bool, _Shape]] = set()  # (region hidden, shape) that did not fit behind the head
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
            variants = [(f, v) for f, v in variants if (hide, _shape(v)) not in failed]
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
                    failed.add((hide, _shape(variant)))
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
    flavors: dict[str, str] = {}
    refused: dict[str, str] = {}
    order = _order(pending, book, queues)
    deadline = time.perf_counter() + budget_s if budget_s > 0 else math.inf
    # A claimant's quota is kept for it as its GPUs are: its demand is charged to its queue until its turn (so no
    # gang served before it takes the quota it needs), and while it waits after it.
    kept = _keep_claimed_quota(book, shield, pending)
    recharge: tuple[str, str, GangRequest] | None = None  # the last claimant tried, until it is placed
    behind: _BehindHead | None = None  # the gangs behind the head, once there is one
    try:
        for queue, request in order:
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
