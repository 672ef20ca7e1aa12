"""Gang placement: every replica at once, under the lowest common switch, best fit among equals.

The algorithm (this issue's level; the full topology objective builds on it):
1. Count, per node, how many replicas of G GPUs its free GPUs hold ("slots").
2. Going up the tiers (node, leaf, spine, ..., cluster), find the lowest tier where one domain holds all R
   replicas. Among the domains of that tier that do, take the one with the least free GPUs (best fit, global
   within the tier), so emptier domains stay whole for larger gangs.
3. Inside it, span as few child domains as possible: the fullest-fitting child first, the remainder into the
   tightest child that holds it; recursively down to nodes.
4. Ranks follow the switch order of their nodes, so ring neighbours share the closest switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .capacity import ClusterCapacity
from .model import GangRequest, NodeCapacity, Placement, ReplicaPlacement


@dataclass(frozen=True, slots=True)
class Unplaceable:
    job_id: str
    reason: str


def tier_names(capacity: ClusterCapacity, fabric_tiers: Sequence[str] = ()) -> list[str]:
    depth = capacity.levels() - 1
    names = list(fabric_tiers[:depth])
    while len(names) < depth:
        names.append(f"tier{len(names)}")
    return ["node", *names, "cluster"]


def _key(node: NodeCapacity, level: int) -> str:
    """Domain of `node` at a switch level below the top: 0 is the node itself, i >= 1 its switch of tier i-1."""
    if level == 0:
        return node.name
    if level - 1 < len(node.path):
        return node.path[level - 1]
    return ""


def place_gang(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str] = ()
) -> Placement | Unplaceable:
    """Place all replicas of `request` at once, or say why not. Does not change `capacity`."""
    g, need = request.gpus_per_replica, request.replicas
    if not capacity.nodes or g < 1:
        return Unplaceable(request.job_id, "the cluster has no nodes")
    top = capacity.levels()
    total_slots, free_now = capacity.domain_stats(top, g).get("", (0, 0))
    if total_slots < need:
        return Unplaceable(
            request.job_id,
            f"needs {need} x {g} GPUs; free capacity holds {total_slots} such replica(s) now ({free_now} GPUs free)",
        )
    names = tier_names(capacity, fabric_tiers)
    most_nodes, largest = capacity.shape()
    for level in range(top + 1):
        if level < top and most_nodes[level] * (largest // g) < need:
            continue  # no domain of this tier could hold the gang even empty
        if level == 0:
            node = capacity.tightest_node(need * g)
            if node is not None:
                return _build(request, [(node, need)], names, 0)
            continue
        # Best fit, global within the tier: the fitting domain with the least free GPUs (from the index).
        stats = capacity.domain_stats(level, g)
        fitting = [k for k, (slots, _) in stats.items() if slots >= need]
        if not fitting:
            continue
        best = min(fitting, key=lambda k: (stats[k][1], k))
        members = [n for n in capacity.members(level, best) if n.schedulable and len(n.free) >= g]
        return _build(request, _take(members, need, g, level), names, level)
    raise AssertionError("the cluster level always fits when total slots suffice")


def _take(nodes: list[NodeCapacity], need: int, g: int, level: int) -> list[tuple[NodeCapacity, int]]:
    """Choose `need` replica slots among `nodes` (all inside one domain of `level`), spanning few children."""
    if level == 0:
        (node,) = nodes
        return [(node, need)]
    groups: dict[str, list[NodeCapacity]] = {}
    for node in nodes:
        groups.setdefault(_key(node, level - 1), []).append(node)
    stats = {k: (sum(n.slots(g) for n in ns), sum(len(n.free) for n in ns)) for k, ns in groups.items()}
    # Fullest children first; the remainder goes to the tightest child that holds all of it. Sorted once, so the
    # children that could take the whole remainder are always a prefix of what is left.
    order = sorted(groups, key=lambda k: (-stats[k][0], stats[k][1], k))
    chosen: list[tuple[NodeCapacity, int]] = []
    remaining = need
    for i, key in enumerate(order):
        if stats[key][0] >= remaining:
            prefix = order[i:]
            end = next((j for j, k in enumerate(prefix) if stats[k][0] < remaining), len(prefix))
            key = min(prefix[:end], key=lambda k: (stats[k][1], k))
            return chosen + _take(groups[key], remaining, g, level - 1)
        chosen += _take(groups[key], stats[key][0], g, level - 1)
        remaining -= stats[key][0]
    raise AssertionError("the domain was chosen because it holds the gang")


def _build(request: GangRequest, takes: list[tuple[NodeCapacity, int]], names: list[str], level: int) -> Placement:
    g = request.gpus_per_replica
    ordered = sorted(takes, key=lambda t: (tuple(reversed(t[0].path)), t[0].name))
    replicas: list[ReplicaPlacement] = []
    for node, count in ordered:
        free = sorted(node.free)[: count * g]
        for i in range(count):
            replicas.append(ReplicaPlacement(len(replicas), node.name, tuple(free[i * g:(i + 1) * g])))
    spanned = len({_key(node, level - 1) for node, _ in takes}) if level > 0 else 1
    tier = names[level]
    child = names[level - 1] if level > 0 else "node"
    if level == 0:
        reason = f"{request.replicas} x {g} GPUs inside node {takes[0][0].name}"
    else:
        reason = f"{request.replicas} x {g} GPUs on {len(takes)} nodes under one {tier}, spanning {spanned} {child}(s)"
    return Placement(request.job_id, tuple(replicas), tier, spanned, float(level * 1000 + spanned), reason)


def schedule_in_order(
    capacity: ClusterCapacity, pending: Sequence[GangRequest], fabric_tiers: Sequence[str] = ()
) -> tuple[list[Placement], Unplaceable | None]:
    """Serve `pending` in priority, then submission order: each gang all at once, or the queue stops there.

    Strict order means a large gang at the head is never starved by smaller ones behind it; it waits holding
    nothing. Reserves each placement in `capacity` as it goes. Returns the placements and, when the queue
    stopped at a gang that does not fit now, why.
    """
    placements: list[Placement] = []
    for request in queue_order(pending):
        result = place_gang(capacity, request, fabric_tiers)
        if isinstance(result, Unplaceable):
            return placements, result
        capacity.reserve(result)
        placements.append(result)
    return placements, None


def queue_order(pending: Sequence[GangRequest]) -> list[GangRequest]:
    """Priority (higher first), then submission time, then id: the order every replica agrees on."""
    return sorted(pending, key=lambda r: (-r.priority, r.submitted_at, r.job_id))
