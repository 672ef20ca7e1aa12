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
from .closeness import GpuCloseness, closest_sets
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


def tier_level(capacity: ClusterCapacity, tier: str, fabric_tiers: Sequence[str] = ()) -> int | None:
    """Level of a tier name: 0 for "node", 1.. for the fabric tiers, the top for "cluster"; None if unknown.

    A fabric tier deeper than any node's switch path (the nodes sit directly under the root there) is the top.
    """
    names = tier_names(capacity, fabric_tiers)
    if tier in names:
        return names.index(tier)
    if tier in fabric_tiers:
        return capacity.levels()
    return None


def place_gang(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str] = ()
) -> Placement | Unplaceable:
    """Place all replicas of `request` at once, or say why not. Does not change `capacity`.

    `request.required_tier`: only domains of that tier or below are tried; when no single domain of it holds the
    gang the answer is Unplaceable (never a placement that crosses a higher tier). `request.preferred_tier` is best
    effort and needs no search of its own: the lowest tier that fits is always taken, so the gang lands under one
    domain of the preferred tier whenever one fits, and otherwise at the lowest tier above it that fits (the
    reason then says the preference was not met).
    """
    g, need = request.gpus_per_replica, request.replicas
    if not capacity.nodes or g < 1:
        return Unplaceable(request.job_id, "the cluster has no nodes")
    top = capacity.levels()
    names = tier_names(capacity, fabric_tiers)
    limit = top
    if request.required_tier:
        limit = tier_level(capacity, request.required_tier, fabric_tiers)
        if limit is None:
            return Unplaceable(
                request.job_id,
                f"unknown required_tier {request.required_tier!r}; this cluster has {', '.join(names)}",
            )
    total_slots, free_now = capacity.domain_stats(top, g).get("", (0, 0))
    if total_slots < need:
        return Unplaceable(
            request.job_id,
            f"needs {need} x {g} GPUs; free capacity holds {total_slots} such replica(s) now ({free_now} GPUs free)",
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
        # Among the domains of this tier that hold the gang: fewest children spanned first, then best fit (least
        # free GPUs), global within the tier; all read from the index.
        stats = capacity.domain_stats(level, g)
        fitting = sorted((free, k) for k, (slots, free) in stats.items() if slots >= need)
        if not fitting:
            continue
        best = _fewest_children(capacity, level, fitting, need, g, most_nodes, largest)
        if capacity.is_tree or level == 1:
            takes = _take_indexed(capacity, level, best[1], need, g)
        else:
            members = [n for n in capacity.members(level, best[1]) if n.schedulable and len(n.free) >= g]
            takes = _take(members, need, g, level)
        return _preferred(request, _build(request, takes, names, level), names, fabric_tiers, capacity)
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


def _fewest_children(
    capacity: ClusterCapacity, level: int, fitting: list[tuple[int, str]], need: int, g: int,
    most_nodes: list[int], largest: int,
) -> tuple[int, str]:
    """The fitting domain (given as (free, key), best fit first) that spans the fewest children; ties keep best fit.

    Stops at the first domain that reaches the lower bound no domain can beat (children that are empty and as big
    as any child of this tier), which in a mostly empty cluster is the first one looked at.
    """
    if level > 1 and not capacity.is_tree:
        return fitting[0]  # child statistics need a tree; a switch under two parents keeps plain best fit
    per_child = max(1, most_nodes[level - 1] * (largest // g)) if level > 1 else max(1, largest // g)
    bound = -(-need // per_child)
    best: tuple[int, int, str] | None = None
    for free, key in fitting:
        slots = sorted((s for s, _ in capacity.child_stats(level, key, g).values()), reverse=True)
        count, held = 0, 0
        for s in slots:
            count += 1
            held += s
            if held >= need:
                break
        if best is None or count < best[0]:
            best = (count, free, key)
            if count <= bound:
                break
    return best[1], best[2]


def _preferred(
    request: GangRequest, placement: Placement, names: list[str], fabric_tiers: Sequence[str],
    capacity: ClusterCapacity,
) -> Placement:
    """Note in the reason when the preferred tier could not be met (the placement itself is already the lowest)."""
    if not request.preferred_tier:
        return placement
    want = tier_level(capacity, request.preferred_tier, fabric_tiers)
    if want is None or names.index(placement.tier) <= want:
        return placement
    reason = f"{placement.reason}; no single {request.preferred_tier} (preferred_tier) holds it now"
    return Placement(placement.job_id, placement.replicas, placement.tier, placement.domains, placement.score, reason)


def _order_and_pick(stats: dict[str, tuple[int, int]], need: int) -> tuple[list[tuple[str, int]], str | None, int]:
    """Fullest children first; the remainder goes to the tightest child that holds all of it.

    Returns the children taken whole (key, replicas), the child that takes the remainder, and the remainder.
    Sorted once, so the children that could take the whole remainder are always a prefix of what is left.
    """
    order = sorted(stats, key=lambda k: (-stats[k][0], stats[k][1], k))
    whole: list[tuple[str, int]] = []
    remaining = need
    for i, key in enumerate(order):
        if stats[key][0] >= remaining:
            prefix = order[i:]
            end = next((j for j, k in enumerate(prefix) if stats[k][0] < remaining), len(prefix))
            return whole, min(prefix[:end], key=lambda k: (stats[k][1], k)), remaining
        whole.append((key, stats[key][0]))
        remaining -= stats[key][0]
    raise AssertionError("the domain was chosen because it holds the gang")


def _take_indexed(
    capacity: ClusterCapacity, level: int, key: str, need: int, g: int
) -> list[tuple[NodeCapacity, int]]:
    """`_take` read from the capacity index: only the children of chosen domains are looked at, so a gang costs
    O(domains it touches), not O(nodes of the domain)."""
    if level == 0:
        return [(capacity.nodes[key], need)]
    whole, last, remaining = _order_and_pick(capacity.child_stats(level, key, g), need)
    chosen: list[tuple[NodeCapacity, int]] = []
    for child, slots in whole:
        chosen += _take_indexed(capacity, level - 1, child, slots, g)
    return chosen + _take_indexed(capacity, level - 1, last, remaining, g)


def _take(nodes: list[NodeCapacity], need: int, g: int, level: int) -> list[tuple[NodeCapacity, int]]:
    """Choose `need` replica slots among `nodes` (all inside one domain of `level`), spanning few children.

    The scan version, for fabrics whose domains do not form a tree (a switch under two parents)."""
    if level == 0:
        (node,) = nodes
        return [(node, need)]
    groups: dict[str, list[NodeCapacity]] = {}
    for node in nodes:
        groups.setdefault(_key(node, level - 1), []).append(node)
    stats = {k: (sum(n.slots(g) for n in ns), sum(len(n.free) for n in ns)) for k, ns in groups.items()}
    whole, last, remaining = _order_and_pick(stats, need)
    chosen: list[tuple[NodeCapacity, int]] = []
    for child, slots in whole:
        chosen += _take(groups[child], slots, g, level - 1)
    return chosen + _take(groups[last], remaining, g, level - 1)


def pick_gpus(
    free: set[int] | frozenset[int], k: int, closeness: GpuCloseness | None = None
) -> tuple[int, ...]:
    """`k` GPU indices out of `free`.

    Without `closeness` (or with a uniform one, where every pair is equally close), by index: contiguous blocks
    as a proxy for sharing a PCIe switch / NUMA half. In order: the lowest naturally aligned free block when `k`
    is a power of two (GPUs 0-3 or 4-7 for k=4, never 2-5), else the lowest contiguous free run of `k`, else the
    `k` lowest free indices. Deterministic: the same free set always gives the same answer, which rail alignment
    relies on.

    With `closeness` (the node's per-pair topo matrix): the `k` free GPUs whose worst pair is closest (NV18 >
    ... > NV1 > PIX > PXB > PHB > NODE > SYS), then the largest sum of pairwise closeness, then the index order
    above among those equally close. When there are too many sets to try (large nodes), by index as above.
    """
    if closeness is not None and not closeness.uniform and 1 < k < len(free):
        sets = closest_sets(closeness, free, k)
        if sets is not None:
            return min(sets, key=lambda s: (_shape(s, k), s))
    ordered = sorted(free)
    if k >= len(ordered):
        return tuple(ordered[:k])
    if k & (k - 1) == 0:
        for start in ordered:
            if start % k == 0 and all(start + i in free for i in range(1, k)):
                return tuple(range(start, start + k))
    for i in range(len(ordered) - k + 1):
        if ordered[i + k - 1] - ordered[i] == k - 1:
            return tuple(ordered[i:i + k])
    return tuple(ordered[:k])


def _shape(gpus: tuple[int, ...], k: int) -> int:
    """The index order of `pick_gpus`: 0 an aligned power-of-two block, 1 a contiguous run, 2 anything else."""
    if gpus[-1] - gpus[0] != k - 1:
        return 2
    return 0 if k & (k - 1) == 0 and gpus[0] % k == 0 else 1


def _split_close(gpus: tuple[int, ...], count: int, g: int, closeness: GpuCloseness) -> tuple[int, ...]:
    """Order the GPUs of `count` replicas of `g` on one node so each replica's slice is as close as it can be:
    the closest `g` first, then the closest `g` of the rest, and so on."""
    rest, ordered = set(gpus), []
    for _ in range(count - 1):
        part = pick_gpus(rest, g, closeness)
        ordered += part
        rest -= set(part)
    return tuple(ordered) + tuple(sorted(rest))


def _build(request: GangRequest, takes: list[tuple[NodeCapacity, int]], names: list[str], level: int) -> Placement:
    """Number the replicas in switch order and choose their GPUs.

    Rail alignment: in a rail-optimized fabric GPU i of every node sits on rail i, so every node of a gang that
    leaves GPUs over takes the same GPU indices where it can: its choice is made from the GPUs free on every node
    of the gang (`pick_gpus` of the intersection, so equal needs get equal indices) and local rank i uses the same
    rail everywhere. A node whose need the intersection cannot cover picks from its own free GPUs.

    Intra-node closeness (`NodeCapacity.closeness`, the node's topo matrix) decides only when the whole gang
    sits on one node: a multi-node gang keeps the rail-aligned, index-based choice, because the same indices on
    every node (one rail per local rank) matter more for its traffic than the links inside each node.
    """
    g = request.gpus_per_replica
    ordered = sorted(takes, key=lambda t: (tuple(reversed(t[0].path)), t[0].name))
    common: set[int] | None = None
    if len(ordered) > 1:
        for node, _ in ordered:
            common = set(node.free) if common is None else common & node.free
    replicas: list[ReplicaPlacement] = []
    single = len(ordered) == 1
    for node, count in ordered:
        k = count * g
        closeness = node.closeness if single else None
        if k == len(node.free):
            gpus = tuple(sorted(node.free))
        elif common is not None and len(common) >= k:
            gpus = pick_gpus(common, k)
        else:
            gpus = pick_gpus(node.free, k, closeness)
        if closeness is not None and not closeness.uniform and count > 1 and g > 1:
            gpus = _split_close(gpus, count, g, closeness)
        for i in range(count):
            replicas.append(ReplicaPlacement(len(replicas), node.name, gpus[i * g:(i + 1) * g]))
    spanned = len({_key(node, level - 1) for node, _ in takes}) if level > 0 else 1
    tier = names[level]
    child = names[level - 1] if level > 0 else "node"
    if level == 0:
        reason = f"{request.replicas} x {g} GPUs inside node {takes[0][0].name}"
    else:
        reason = f"{request.replicas} x {g} GPUs on {len(takes)} nodes under one {tier}, spanning {spanned} {child}(s)"
    return Placement(request.job_id, tuple(replicas), tier, spanned, float(level * 1000 + spanned), reason)


def place_replicas_one_by_one(
    capacity: ClusterCapacity,
    request: GangRequest,
    held: Sequence[ReplicaPlacement] = (),
    limit: int | None = None,
) -> tuple[ReplicaPlacement, ...]:
    """Per-replica mode, no gang semantics: the simulator's baseline of a stock Kubernetes scheduler.

    Places the replicas `request` still lacks (beyond those in `held`) one at a time, each on the best-fit node
    (the tightest node with room), reserving it in `capacity` at once; stops when no node has room, or after
    `limit` new replicas. Returns `held` plus the replicas placed now: a partial gang keeps what it got, which is
    how two gangs can each hold part of the cluster and both wait forever. The scheduler never uses it.
    """
    placed = list(held)
    g = request.gpus_per_replica
    new = 0
    while len(placed) < request.replicas and (limit is None or new < limit) and g >= 1:
        node = capacity.tightest_node(g)
        if node is None:
            break
        gpus = pick_gpus(node.free, g)
        capacity.take(node.name, gpus)
        placed.append(ReplicaPlacement(len(placed), node.name, gpus))
        new += 1
    return tuple(placed)


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
