"""The public entry of placement: `place_gang` (a gang whole or a reason why not), with what comes around the
search: host CPUs and memory (`_with_host_resources`), struck nodes (`_place_avoiding`), GPU models, partial GPUs,
required and preferred tiers, and the tier where one domain holds the gang (`_place_gang`). Also the queue order
every replica agrees on (`queue_order`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..capacity import ClusterCapacity
from ..model import GangRequest, Placement
from ..resources import check_use, describe, format_cpus, human_size, room
from ..shares import place_partial
from .budget import _Budget
from .gpus import _build, pick_gpus
from .result import Unplaceable
from .search import _fewest_children, _IndexView, _Objective, _take, _take_indexed
from .segments import place_segments
from .tiers import tier_level, tier_names


def place_gang(
    capacity: ClusterCapacity,
    request: GangRequest,
    fabric_tiers: Sequence[str] = (),
    *,
    budget_ms: float | None = None,
    cells: int | None = None,
) -> Placement | Unplaceable:
    """Place all replicas of `request` at once, or say why not. Does not change `capacity`.

    `budget_ms`: the time budget of the exact search (None: `capacity.placement_budget_ms`; 0: none). `cells`: its
    deterministic work bound per knapsack (None: `_EXACT_CELLS`). See the comment above `_EXACT_CELLS`: past
    either, the search keeps its heuristic fill there and the reason says so.

    `request.required_tier`: only domains of that tier or below are tried; when no single domain of it holds the
    gang the answer is Unplaceable (never a placement that crosses a higher tier). `request.preferred_tier` is best
    effort and needs no search of its own: the lowest tier that fits is always taken, so the gang lands under one
    domain of the preferred tier whenever one fits, and otherwise at the lowest tier above it that fits (the
    reason then says the preference was not met).

    An elastic gang (`request.min_replicas`) gets the most replicas that fit, from `replicas` down to its minimum
    (_place_elastic).

    `request.avoid` (nodes that struck the gang): placed with those nodes hidden first; only when it fits nowhere
    else is it placed as if they were not struck.

    `capacity.lending` (the spare pools' booked nodes, phalanx.core.pools) is hidden from a gang without a time limit;
    a gang with one is placed off them when it fits elsewhere, and borrows them only when it does not.
    """
    if capacity.lending:  # the spare pools' nodes: lent to time-limited gangs only, and only when needed
        got = _place_any(capacity.unlent(), request, fabric_tiers, budget_ms, cells)
        if request.time_limit <= 0 or isinstance(got, Placement):
            return got
    return _place_any(capacity, request, fabric_tiers, budget_ms, cells)


def _place_any(
    capacity: ClusterCapacity,
    request: GangRequest,
    fabric_tiers: Sequence[str],
    budget_ms: float | None,
    cells: int | None,
) -> Placement | Unplaceable:
    if request.elastic:  # the most replicas that fit, between its minimum and maximum (_place_elastic)
        return _place_elastic(
            request, lambda fixed: place_gang(capacity, fixed, fabric_tiers, budget_ms=budget_ms, cells=cells)
        )
    bounds = (capacity.placement_budget_ms if budget_ms is None else budget_ms, cells)
    if request.cpu_milli or request.memory:
        return _with_host_resources(capacity, request, fabric_tiers, bounds)
    return _place_avoiding(capacity, request, fabric_tiers, bounds)


def _with_host_resources(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str], bounds: tuple[float, int | None]
) -> Placement | Unplaceable:
    """Place a gang whose replicas also ask for host CPUs or memory: on the GPUs those can feed (_fitted_view),
    each replica then carrying what it asks.

    First as if they asked for none: when that placement's nodes can feed it (check_use), it is the answer, at the
    cost of a GPU-only placement; and when the GPUs alone cannot hold the gang, no view with fewer can. Only a
    placement that lands where the CPUs or the memory run out pays for the narrowed view (a look at every node
    with a free GPU, and an index edited both ways): issue 35's bound for placement with CPUs and memory."""
    first = _place_avoiding(capacity, request, fabric_tiers, bounds)
    if isinstance(first, Unplaceable):
        return first
    fitted = _carrying(first, request)
    if not check_use(capacity.nodes, fitted.replicas):
        return fitted
    changes = _fitted_view(capacity, request)
    with capacity.narrowed(changes):
        got = _place_avoiding(capacity, request, fabric_tiers, bounds)
    if isinstance(got, Unplaceable):
        if changes:
            got = Unplaceable(
                got.job_id,
                f"{got.reason}; each replica also needs {describe(request.cpu_milli, request.memory)}, which "
                f"{len(changes)} node(s) lack for more of its replicas (the most free on one node: "
                f"{_most_room(capacity, request.cpu_milli, request.memory)})",
            )
        return got
    return _carrying(got, request)


def _carrying(placement: Placement, request: GangRequest) -> Placement:
    """`placement` with each replica carrying the host resources the gang's replicas ask for."""
    return replace(
        placement,
        replicas=tuple(replace(r, cpu_milli=request.cpu_milli, memory=request.memory) for r in placement.replicas),
    )


def _fitted_view(capacity: ClusterCapacity, request: GangRequest) -> dict[str, tuple[set[int], bool]]:
    """The nodes whose free CPUs or memory feed fewer of the gang's replicas than their free GPUs would hold, each
    with what it offers the gang: only the GPUs those replicas take (the closest set, by pick_gpus), or nothing.
    Empty when no node binds (the common case: a scan, and the GPU index as it is).

    A whole-GPU replica takes `gpus_per_replica` GPUs, so a node feeding k replicas offers k x that many. A gang of
    one replica needs only a node that feeds one: the nodes that feed none are hidden, and the others keep their
    free GPUs (best fit by GPUs among the nodes that can feed it; no GPU set to pick per node). A partial replica (a
    MIG instance or a share) takes part of one GPU, several to a GPU: a node feeding none is hidden, and
    place_partial stops using a node once its replicas there use up what it feeds (it takes each replica's host
    resources as it places it).
    """
    cpu, memory = request.cpu_milli, request.memory
    if not (cpu or memory):
        return {}
    g = request.gpus_per_replica
    changes: dict[str, tuple[set[int], bool]] = {}
    if request.partial:  # a node with no whole GPU free may still hold partial replicas: every node is looked at
        for node in capacity.nodes.values():
            if node.schedulable and room(node, cpu, memory) == 0:
                changes[node.name] = (node.free, False)
        return changes
    # Whole GPUs: a node binds only where k x g < its free GPUs, so never one with none free; the index lists the
    # others (on a busy cluster, a fraction of the nodes: issue 35's CPU-and-memory placement bound). room(),
    # inlined: this loop is the cost of a placement where the host resources bind.
    single = request.replicas == 1
    for node in capacity.nodes_with_free():
        k = -1
        if cpu:
            k = max(0, node.cpu_milli - node.cpu_used) // cpu
        if memory:
            by_memory = max(0, node.memory - node.memory_used) // memory
            k = by_memory if k < 0 else min(k, by_memory)
        if k * g >= len(node.free):
            continue
        if k == 0:
            changes[node.name] = (set(), True)
        elif not single:
            changes[node.name] = (set(pick_gpus(node.free, k * g, node.closeness)), True)
    return changes


def _most_room(capacity: ClusterCapacity, cpu: int, memory: int) -> str:
    """The most free CPUs and memory on one schedulable node, for a reason: '6 CPUs and 48G memory'."""
    best_cpu = max((n.cpu_milli - n.cpu_used for n in capacity.nodes.values() if n.schedulable), default=0)
    best_mem = max((n.memory - n.memory_used for n in capacity.nodes.values() if n.schedulable), default=0)
    parts = []
    if cpu:
        parts.append(f"{format_cpus(max(0, best_cpu))} CPUs")
    if memory:
        parts.append(f"{human_size(max(0, best_mem))} memory")
    return " and ".join(parts)


def _place_avoiding(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str], bounds: tuple[float, int | None]
) -> Placement | Unplaceable:
    if request.prefer or request.spread:
        preferred = _place_preferring(capacity, request, fabric_tiers, bounds)
        if preferred is not None:
            return preferred
    if request.avoid:
        hidden = [n for n in request.avoid if n in capacity.nodes and capacity.nodes[n].schedulable]
        if hidden:
            for name in hidden:
                capacity.set_schedulable(name, False)
            try:
                got = _place_gang(capacity, request, fabric_tiers, bounds)
            finally:
                for name in hidden:
                    capacity.set_schedulable(name, True)
            if isinstance(got, Placement):
                return got
        got = _place_gang(capacity, request, fabric_tiers, bounds)
        if isinstance(got, Placement) and set(got.nodes) & request.avoid:
            struck = sorted(set(got.nodes) & request.avoid)
            got = replace(
                got,
                reason=f"{got.reason}; on node(s) {', '.join(struck)} that struck it before: it fits nowhere else now",
            )
        return got
    return _place_gang(capacity, request, fabric_tiers, bounds)


def _place_hiding(
    capacity: ClusterCapacity,
    request: GangRequest,
    fabric_tiers: Sequence[str],
    bounds: tuple[float, int | None],
    hidden: list[str],
) -> Placement | Unplaceable:
    for name in hidden:
        capacity.set_schedulable(name, False)
    try:
        return _place_gang(capacity, request, fabric_tiers, bounds)
    finally:
        for name in hidden:
            capacity.set_schedulable(name, True)


def _place_preferring(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str], bounds: tuple[float, int | None]
) -> Placement | None:
    """A service replica's soft preferences, tried before the plain search: first only the nodes it ran on before
    (`prefer`), then every node but its siblings' domains (`spread`), struck nodes hidden in both. None: neither
    holds it, and the plain search decides (a preference never makes a gang wait)."""
    live = [name for name, node in capacity.nodes.items() if node.schedulable]
    if request.prefer:
        hidden = [n for n in live if n not in request.prefer or n in request.avoid]
        got = _place_hiding(capacity, request, fabric_tiers, bounds, hidden)
        if isinstance(got, Placement):
            return replace(got, reason=f"{got.reason}; back in the domain it ran in before")
    if request.spread:
        hidden = [n for n in live if n in request.spread or n in request.avoid]
        got = _place_hiding(capacity, request, fabric_tiers, bounds, hidden)
        if isinstance(got, Placement):
            return replace(got, reason=f"{got.reason}; in a domain apart from its sibling replicas")
    return None


def _place_gang(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str], bounds: tuple[float, int | None]
) -> Placement | Unplaceable:
    if request.partial:
        result = place_partial(capacity, request, tier_names(capacity, fabric_tiers))
        return result if isinstance(result, Placement) else Unplaceable(result.job_id, result.reason)
    if request.gpu_model:
        capacity = capacity.restricted(request.gpu_model)
        if not capacity.nodes:
            return Unplaceable(request.job_id, f"no node has GPU model {request.gpu_model!r}")
    g, need = request.gpus_per_replica, request.replicas
    if not capacity.nodes or g < 1:
        return Unplaceable(request.job_id, "the cluster has no nodes")
    if request.segment > 0 and need % request.segment == 0:
        got = place_segments(capacity, request, fabric_tiers, bounds, _place_gang)
        return Unplaceable(request.job_id, got) if isinstance(got, str) else got
    top = capacity.levels()
    names = tier_names(capacity, fabric_tiers)
    limit = top
    if request.required_tier:
        required = tier_level(capacity, request.required_tier, fabric_tiers)
        if required is None:
            return Unplaceable(
                request.job_id,
                f"unknown required_tier {request.required_tier!r}; this cluster has {', '.join(names)}",
            )
        limit = required
    total_slots, free_now = capacity.domain_stats(top, g).get("", (0, 0))
    if total_slots < need:
        in_mig = capacity.mig_mode_gpus
        return Unplaceable(
            request.job_id,
            f"needs {need} x {g} GPUs; free capacity holds {total_slots} such replica(s) now ({free_now} GPUs free"
            + (f"; {in_mig} GPU(s) in MIG mode take only MIG instances" if in_mig else "")
            + ")",
        )
    most_nodes, largest = capacity.shape()
    for level in range(limit + 1):
        if level < top and most_nodes[level] * (largest // g) < need:
            continue  # no domain of this tier could hold the gang even empty
        if level == 0:
            node = capacity.tightest_node(need * g)
            if node is not None:
                return _preferred(request, _build(request, [(node, need)], names, 0), names, fabric_tiers, capacity)
            continue
        # Among the domains of this tier that hold the gang: fewest children spanned first, then fewest domains of
        # each level below, then best fit (least free GPUs), global within the tier; all read from the index.
        stats = capacity.domain_stats(level, g)
        fitting = [(free, k) for k, (slots, free) in stats.items() if slots >= need]
        if not fitting:
            continue
        budget = _Budget(*bounds)  # the search starts here (a gang on one node needs none)
        objective = _Objective(_IndexView(capacity, g), need, budget)
        best = _fewest_children(capacity, level, fitting, need, g, most_nodes, largest, objective)
        if capacity.is_tree or level == 1:
            takes = _take_indexed(capacity, level, best[1], need, g, objective)
        else:
            members = [n for n in capacity.members(level, best[1]) if n.schedulable and len(n.free) >= g]
            takes = _take(members, need, g, level, budget)
        placement = _build(request, takes, names, level)
        if budget.stopped or budget.capped:
            placement = replace(placement, reason=f"{placement.reason} {budget.note()}")
        return _preferred(request, placement, names, fabric_tiers, capacity)
    if limit < top:
        tier = names[limit]
        if limit == 0:
            most = capacity.most_free_on_a_node() // g
        else:
            most = max((slots for slots, _ in capacity.domain_stats(limit, g).values()), default=0)
        return Unplaceable(
            request.job_id,
            f"needs {need} x {g} GPUs under one {tier} (required_tier); the best {tier} holds {most} such "
            f"replica(s) now",
        )
    raise AssertionError("the cluster level always fits when total slots suffice")


def _preferred(
    request: GangRequest,
    placement: Placement,
    names: list[str],
    fabric_tiers: Sequence[str],
    capacity: ClusterCapacity,
) -> Placement:
    """Note in the reason when the preferred tier could not be met (the placement itself is already the lowest)."""
    if not request.preferred_tier:
        return placement
    want = tier_level(capacity, request.preferred_tier, fabric_tiers)
    if want is None or names.index(placement.tier) <= want:
        return placement
    return replace(
        placement, reason=f"{placement.reason}; no single {request.preferred_tier} (preferred_tier) holds it now"
    )


_QUEUE_ORDER = operator.attrgetter("order")


def queue_order(pending: Sequence[GangRequest]) -> list[GangRequest]:
    """Priority (higher first), then submission time, then id: the order every replica agrees on."""
    return sorted(pending, key=_QUEUE_ORDER)


def _place_elastic(
    request: GangRequest, place: Callable[[GangRequest], Placement | Unplaceable]
) -> Placement | Unplaceable:
    """The largest placement of an elastic gang between its minimum and maximum sizes; Unplaceable (saying the
    minimum does not fit) when not even `min_replicas` fit. `place` places a fixed-size gang.

    A segmented gang's sizes are whole segments (`request.segment` replicas, its spares counted: elastic_units), so
    the search runs over segment counts. Fitting is monotone in the size (dropping a replica, or a segment, from a
    placement leaves a placement of the smaller gang, under the same tier constraints), so the largest size that
    fits is found by trying the maximum, then the minimum, then a binary search between them: at most
    2 + log2(MAX - MIN) placements, and one in the common case (it fits whole)."""
    step = request.segment if request.segment > 0 else 1
    low, high = -(-request.min_replicas // step), request.replicas // step  # in units of `step` replicas

    def at(units: int) -> Placement | Unplaceable:
        return place(replace(request, replicas=units * step, min_replicas=0))

    what, most = ("segments" if step > 1 else "replicas"), high  # (a segment's count is the user's, spares or not)
    best = at(high)
    if isinstance(best, Placement):
        return best
    least = at(low)
    if isinstance(least, Unplaceable):
        return Unplaceable(
            request.job_id, f"not even its minimum of {low} of {high} {what} (elastic) fits: {least.reason}"
        )
    found, low = least, low + 1  # invariant: `found` fits at low - 1; nothing fits at high
    while low < high:
        mid = (low + high) // 2
        got = at(mid)
        if isinstance(got, Placement):
            found, low = got, mid + 1
        else:
            high = mid
    return replace(
        found,
        reason=f"{found.reason}; elastic: {len(found.replicas) // step} of at most {most} {what} fit now",
    )
