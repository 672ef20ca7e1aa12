"""Multi-level gangs (segments): a gang of R replicas cut into R / S segments of S replicas, each segment wholly
inside one domain of a segment tier (an NVLink domain such as a GB200 NVL72 rack, by default), the segments spread
over as few higher-tier domains as possible, and a segment's ranks contiguous (segment i holds replicas
i*S .. i*S+S-1). One placement: the caller reserves it at once, all or nothing.

The search is two of the plain one (`gang._place_gang`), one above the other:
1. Outer: every domain D of the segment tier becomes one virtual node holding k_D = floor(slots_D / S) segments
   (slots_D: replicas of G GPUs its free GPUs hold, as the capacity index counts them), under its switches above
   the tier. The plain placement of R / S one-slot replicas on that virtual cluster is then exactly the objective
   above the segment tier: the lowest tier where one domain holds every segment, the fewest children, the fewest
   domains of each level below down to segment domains, best fit (counted in segments) among equals, with the
   exact search's bounds (`budget._Budget`) and its rank order (switch order).
2. Inner: each segment, in that order, is placed inside its domain by the plain objective (`_take_indexed`: the
   fewest nodes, best fit) and held while the next ones of its domain are placed, so two segments of one domain
   never share a GPU; a domain holding k_D segments always holds the k-th one (S replicas of its k_D * S slots are left).

Complexity: O(D) to read the segment domains from the index (D domains of the segment tier) and to build the virtual
cluster, plus one plain placement of R / S replicas on D virtual nodes, plus R / S placements of S replicas, each
inside one domain (nodes of a domain N_D: O(N_D log N_D) with the greedy fill, which is exact when a domain's
children are nodes, as NVLink domains' are). Each of the two searches has the time budget `placement_budget_ms`
and the DP cell bound, so the whole stays within about twice the budget plus that linear work. Measured in
bench/segments.py (1,152 nodes in 64 NVL72 domains).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ..capacity import ClusterCapacity
from ..fabric import NVLINK_TIER
from ..model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from .budget import _Budget
from .gpus import _build
from .result import Unplaceable
from .search import _IndexView, _Objective, _take, _take_indexed
from .tiers import domain_of, tier_level, tier_names

# What the plain search is: gang._place_gang (handed in, so this module does not import gang).
_Place = Callable[[ClusterCapacity, GangRequest, Sequence[str], tuple[float, int | None]], Placement | Unplaceable]


def default_segment_tier(fabric_tiers: Sequence[str]) -> str:
    """The tier a segment lies in when the gang names none: the NVLink domain where the fabric has one, else the
    leaf (the lowest switch tier), else the cluster (a fabric without switches: segments are only rank blocks)."""
    if NVLINK_TIER in fabric_tiers:
        return NVLINK_TIER
    return fabric_tiers[0] if fabric_tiers else "cluster"


def segment_tier_of(request: GangRequest, fabric_tiers: Sequence[str]) -> str:
    return request.segment_tier or default_segment_tier(fabric_tiers)


def segment_domains(capacity: ClusterCapacity, level: int, g: int) -> dict[str, tuple[int, int]]:
    """Every domain of `level` with (replicas of `g` GPUs it holds now, free GPUs); level 0: nodes."""
    if level == 0:
        return {n.name: (n.slots(g), len(n.free)) for n in capacity.nodes.values() if n.schedulable and n.slots(g)}
    stats = capacity.domain_stats(level, g)
    stats.pop("", None)  # nodes no switch of this tier names: in no domain of it
    return stats


def place_segments(
    capacity: ClusterCapacity,
    request: GangRequest,
    fabric_tiers: Sequence[str],
    bounds: tuple[float, int | None],
    place: _Place,
) -> Placement | Unplaceable | str:
    """Place a segmented gang (request.segment > 0) whole, or say why not. A str is an Unplaceable reason (the
    caller wraps it); a Unplaceable is the plain search's own answer, passed on."""
    s, g = request.segment, request.gpus_per_replica
    count = request.replicas // s
    names = tier_names(capacity, fabric_tiers)
    tier = segment_tier_of(request, fabric_tiers)
    level = tier_level(capacity, tier, fabric_tiers)
    if level is None:
        return f"unknown segment_tier {tier!r}; this cluster has {', '.join(names)}"
    if request.partial:
        return "segments need whole GPUs per replica (no MIG instance or GPU share)"
    top = capacity.levels()
    plain = replace(request, segment=0, segment_tier="")
    required = tier_level(capacity, request.required_tier, fabric_tiers) if request.required_tier else None
    if level >= top or (required is not None and required <= level):
        # One domain of the segment tier holds the whole gang (the cluster's, or required_tier's): the segments are
        # only blocks of contiguous ranks.
        got = place(capacity, plain, fabric_tiers, bounds)
        if isinstance(got, Placement):
            return replace(got, segments=_domains_of(capacity, got, level, s, names[min(level, top)]))
        return got
    domains = segment_domains(capacity, level, g)
    holds = {key: slots // s for key, (slots, _) in domains.items() if slots >= s}
    total = sum(holds.values())
    if total < count:
        return (
            f"segment {total + 1} of {count} ({s} x {g} GPUs) fits in no free {tier} domain now: the free "
            f"{tier} domains hold {total} such segment(s)"
        )
    virtual = _virtual(capacity, level, holds)
    outer = place(
        virtual,
        GangRequest(request.job_id, count, 1, required_tier=names[required] if required is not None else ""),
        names[level + 1 : top],
        bounds,
    )
    if not isinstance(outer, Placement):
        # Only required_tier makes it fail here (the free domains hold enough segments): say what the best holds.
        assert required is not None, outer.reason
        most = max((k for k, _ in virtual.domain_stats(required - level, 1).values()), default=0)
        return (
            f"{count} segments of {s} x {g} GPUs, each in one {tier}, must lie under one {names[required]} "
            f"(required_tier); the best {names[required]} holds {most} such segment(s) now"
        )
    order = [r.node for r in outer.replicas]  # segment i's domain, the domains in switch order
    got = _fill(capacity, request, level, order, names, _Budget(*bounds))
    vlevel = ["node", *names[level + 1 : top], "cluster"].index(outer.tier)
    real = level + vlevel
    used = len(set(order))
    reason = f"{count} segments of {s} x {g} GPUs, each inside one {tier}, on {used} {tier} domain(s)"
    if vlevel:
        reason += f" under one {names[real]}, spanning {outer.domains} {names[real - 1]}(s)"
    notes = [r for r in (outer.reason, got.reason) if "(exact search" in r]
    if notes:
        reason += " " + notes[0][notes[0].index("(exact search") :]
    spanned = outer.domains if vlevel else used
    return Placement(
        request.job_id, got.replicas, names[real], spanned, float(real * 1000 + spanned), reason, tuple(order)
    )


def _virtual(capacity: ClusterCapacity, level: int, holds: dict[str, int]) -> ClusterCapacity:
    """The segment domains as nodes of `k` one-slot GPUs (k: the segments each holds now), under their switches
    above the segment tier."""
    nodes = []
    for key, k in holds.items():
        if not k:
            continue
        member = capacity.nodes[key] if level == 0 else capacity.members(level, key)[0]
        nodes.append(NodeCapacity(key, k, set(range(k)), path=member.path[level:]))
    return ClusterCapacity(nodes, placement_budget_ms=capacity.placement_budget_ms)


def _fill(
    capacity: ClusterCapacity, request: GangRequest, level: int, order: list[str], names: list[str], budget: _Budget
) -> Placement:
    """Each segment inside its domain, held while the next ones of that domain are placed (and given back after):
    replicas numbered segment by segment. The host resources of a replica are added by the caller."""
    s, g = request.segment, request.gpus_per_replica
    one = replace(request, replicas=s, segment=0, segment_tier="")
    parts: list[Placement] = []
    held: list[Placement] = []
    try:
        for i, key in enumerate(order):
            if level == 0:
                takes = [(capacity.nodes[key], s)]
            elif capacity.is_tree or level == 1:
                takes = _take_indexed(capacity, level, key, s, g, _Objective(_IndexView(capacity, g), s, budget))
            else:
                members = [n for n in capacity.members(level, key) if n.schedulable and len(n.free) >= g]
                takes = _take(members, s, g, level, budget)
            part = _build(one, takes, names, level)
            parts.append(part)
            if i + 1 < len(order) and order[i + 1] == key:  # the next segment shares the domain (order groups them)
                capacity.reserve(part)
                held.append(part)
    finally:
        for part in held:
            capacity.release_placement(part)
    replicas = tuple(
        ReplicaPlacement(i * s + r.replica, r.node, r.gpus) for i, part in enumerate(parts) for r in part.replicas
    )
    note = f" {budget.note()}" if budget.stopped or budget.capped else ""
    return Placement(request.job_id, replicas, names[level], len(set(order)), 0.0, note)


def _domains_of(capacity: ClusterCapacity, placement: Placement, level: int, s: int, top_name: str) -> tuple[str, ...]:
    """The domain of `level` each block of `s` ranks of a placement lies in (the top: the cluster)."""
    out = []
    for i in range(0, len(placement.replicas), s):
        node = capacity.nodes.get(placement.replicas[i].node)
        key = domain_of(node, level) if node is not None and level < capacity.levels() else ""
        out.append(key or top_name)
    return tuple(out)
