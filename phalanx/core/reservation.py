"""The head's reservation (`plan_reservation`): the earliest time a blocked gang fits, assuming every running gang
ends at its time limit, and the region (its whole lowest switch domains) held for it until then; and what it plans
on, the running gangs in end order (`RunningEnd`, `RunningSet`). The rules it serves are in phalanx.core.backfill.
Pure: no I/O."""

from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from .capacity import ClusterCapacity
from .model import GangRequest, Placement
from .placement import domain_of, place_gang, tier_names


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


class InEndOrder:
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
    """Running gangs in end order, read by index: a sorted list or an `InEndOrder` (what the search reads)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> RunningEnd: ...


# What placement depends on besides the capacity (`shape_of`), and what `plan_reservation` remembers per head shape
# and set of nodes out (`ideal_cache`): the head's (tier rank, domains) on an empty cluster, False when it never fits.
Shape = tuple[int, int, str, str, int, str, str, int, int, int]
_IdealKey = tuple[Shape, frozenset[str], frozenset[tuple[str, frozenset[int]]]]
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


def shape_of(r: GangRequest) -> Shape:
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
    running: Sequence[RunningEnd] | RunningSet | InEndOrder,
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
        running = InEndOrder(running)
    gangs: _EndOrdered = running if isinstance(running, InEndOrder) else sorted(running, key=_end_key)
    rank = _tier_rank(capacity, fabric_tiers)
    # The head on an empty cluster (only down nodes and unusable GPUs out): it depends on the shape and on which
    # nodes are out, not on what runs, so it is worked out once per shape while they stay the same.
    down = capacity.unschedulable()
    key: _IdealKey = (shape_of(head), down, frozenset((n, frozenset(g)) for n, g in unusable.items()))
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
