"""The in-node GPU choice and the rank order: which GPUs of a node each replica takes (`pick_gpus`: aligned blocks,
or the closest set by the node's topo matrix; rail alignment across the nodes of a gang), and replicas numbered in
switch order so ring neighbours share the closest switch (`_build`)."""

from __future__ import annotations

from ..closeness import GpuCloseness, closest_sets
from ..model import GangRequest, NodeCapacity, Placement, ReplicaPlacement


def pick_gpus(free: set[int] | frozenset[int], k: int, closeness: GpuCloseness | None = None) -> tuple[int, ...]:
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
            return tuple(ordered[i : i + k])
    return tuple(ordered[:k])


def _shape(gpus: tuple[int, ...], k: int) -> int:
    """The index order of `pick_gpus`: 0 an aligned power-of-two block, 1 a contiguous run, 2 anything else."""
    if gpus[-1] - gpus[0] != k - 1:
        return 2
    return 0 if k & (k - 1) == 0 and gpus[0] % k == 0 else 1


def _split_close(gpus: tuple[int, ...], count: int, g: int, closeness: GpuCloseness) -> tuple[int, ...]:
    """Order the GPUs of `count` replicas of `g` on one node so each replica's slice is as close as it can be:
    the closest `g` first, then the closest `g` of the rest, and so on."""
    rest = set(gpus)
    ordered: list[int] = []
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
    ordered = sorted(takes, key=_switch_order)
    single = len(ordered) == 1
    common: set[int] | None = None
    if not single:
        common = set(ordered[0][0].free)
        for node, _ in ordered:
            common &= node.free
            if not common:
                break
    common_picks: dict[int, tuple[int, ...]] = {}  # k -> pick_gpus(common, k): the same for every node
    replicas: list[ReplicaPlacement] = []
    append = replicas.append
    for node, count in ordered:
        k = count * g
        free = node.free
        if k == len(free):
            gpus = tuple(sorted(free))
        elif common is not None and len(common) >= k:
            got = common_picks.get(k)
            if got is None:
                got = common_picks[k] = pick_gpus(common, k)
            gpus = got
        else:
            gpus = pick_gpus(free, k, node.closeness if single else None)
        if single and node.closeness is not None and not node.closeness.uniform and count > 1 and g > 1:
            gpus = _split_close(gpus, count, g, node.closeness)
        name = node.name
        if count == 1:
            append(ReplicaPlacement(len(replicas), name, gpus))
        else:
            for i in range(count):
                append(ReplicaPlacement(len(replicas), name, gpus[i * g : (i + 1) * g]))
    if level == 0:
        spanned = 1
    elif level == 1:
        spanned = len({node.name for node, _ in takes})
    else:
        at = level - 2  # the switch tier of level - 1 in each node's path
        spanned = len({node.path[at] if at < len(node.path) else "" for node, _ in takes})
    tier = names[level]
    child = names[level - 1] if level > 0 else "node"
    if level == 0:
        reason = f"{request.replicas} x {g} GPUs inside node {takes[0][0].name}"
    else:
        reason = f"{request.replicas} x {g} GPUs on {len(takes)} nodes under one {tier}, spanning {spanned} {child}(s)"
    return Placement(request.job_id, tuple(replicas), tier, spanned, float(level * 1000 + spanned), reason)


def _switch_order(take: tuple[NodeCapacity, int]) -> tuple[tuple[str, ...], str]:
    """Ring order: by switch path from the top down, then by name."""
    node = take[0]
    return node.path[::-1], node.name
