"""Gang placement: every replica at once, under the lowest common switch, best fit among equals.

The objective, lexicographic and top-down (required_tier first: never above it):
1. the lowest tier crossed: the lowest tier where one domain holds all R replicas;
2. the fewest domains of the tier just below it (children of that domain);
3. then the fewest domains of each lower tier in turn, down to nodes (crossing a core: spines, then leaves, then
   nodes). This is not "the fewest leaves anywhere": a gang that fits under one spine on 6 leaves stays there
   even when 3 leaves of 3 spines would hold it;
4. best fit among equals: the domain with the least free GPUs (so emptier domains stay whole for larger gangs),
   and inside it the tightest children.

The algorithm:
1. Count, per node, how many replicas of G GPUs its free GPUs hold ("slots").
2. Going up the tiers (node, leaf, spine, ..., cluster), find the lowest tier where one domain holds the gang.
   Among those domains, take the cheapest by 2-3, then the least free GPUs (`_fewest_children`).
3. Inside it, choose the children and how many replicas each takes by 2-3 (`_plan`): the fullest children whole
   and the remainder into the tightest child that holds it, when that meets a lower bound at every level (always
   when the children are atoms: leaves over nodes, or whenever no node holds two replicas); else a small exact
   knapsack over the children's cost functions (`_select`, see the comment above `_EXACT_CELLS`), with a greedy
   fallback only past the search's bounds (a deterministic work bound in DP cells, and a time budget,
   `placement_budget_ms`); recursively down to nodes. A placement whose search hit a bound says so in its reason.
4. Ranks follow the switch order of their nodes, so ring neighbours share the closest switch.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace
from heapq import heapify, heappop
from math import inf
from time import perf_counter
from typing import Generic, Protocol, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from .capacity import ClusterCapacity
from .closeness import GpuCloseness, closest_sets
from .model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from .resources import describe, format_cpus, human_size, room
from .shares import place_partial
from .status import Code, Status


@dataclass(frozen=True, slots=True)
class Unplaceable:
    job_id: str
    reason: str

    @property
    def status(self) -> Status:
        return Status(Code.UNSCHEDULABLE, self.reason)


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

    `request.avoid` (nodes that struck the gang): placed with those nodes hidden first; only when it fits nowhere
    else is it placed as if they were not struck.
    """
    bounds = (capacity.placement_budget_ms if budget_ms is None else budget_ms, cells)
    if request.cpu_milli or request.memory:
        return _with_host_resources(capacity, request, fabric_tiers, bounds)
    return _place_avoiding(capacity, request, fabric_tiers, bounds)


def _with_host_resources(
    capacity: ClusterCapacity, request: GangRequest, fabric_tiers: Sequence[str], bounds: tuple[float, int | None]
) -> Placement | Unplaceable:
    """Place a gang whose replicas also ask for host CPUs or memory: on the GPUs those can feed (_fitted_view),
    each replica then carrying what it asks."""
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
    return replace(
        got,
        replicas=tuple(replace(r, cpu_milli=request.cpu_milli, memory=request.memory) for r in got.replicas),
    )


def _fitted_view(capacity: ClusterCapacity, request: GangRequest) -> dict[str, tuple[set[int], bool]]:
    """The nodes whose free CPUs or memory feed fewer of the gang's replicas than their free GPUs would hold, each
    with what it offers the gang: only the GPUs those replicas take (the closest set, by pick_gpus), or nothing.
    Empty when no node binds (the common case: a scan, and the GPU index as it is).

    A whole-GPU replica takes `gpus_per_replica` GPUs, so a node feeding k replicas offers k x that many. A partial
    replica (a MIG instance or a share) takes part of one GPU, several to a GPU: a node feeding none is hidden, and
    place_partial stops using a node once its replicas there use up what it feeds (it takes each replica's host
    resources as it places it).
    """
    cpu, memory = request.cpu_milli, request.memory
    g = request.gpus_per_replica
    partial = request.partial
    changes: dict[str, tuple[set[int], bool]] = {}
    for node in capacity.nodes.values():
        if not node.schedulable:
            continue
        k = room(node, cpu, memory)
        if k is None:
            return {}
        if partial:
            if k == 0:
                changes[node.name] = (node.free, False)
        elif k * g < len(node.free):
            changes[node.name] = (set(pick_gpus(node.free, k * g, node.closeness)) if k else set(), True)
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


def _fewest_children(
    capacity: ClusterCapacity,
    level: int,
    fitting: list[tuple[int, str]],
    need: int,
    g: int,
    most_nodes: list[int],
    largest: int,
    objective: _Objective[str] | None = None,
) -> tuple[int, str]:
    """The fitting domain (given as (free, key), in any order) whose best placement is cheapest (`_Objective`:
    fewest children, then fewest domains of each level below, down to nodes); ties keep best fit, then the key.

    Leaves: the cost is the fewest nodes, read from the index; stops at the first leaf that reaches the lower bound
    no leaf can beat (as few nodes as empty ones as big as any would need), in a mostly empty cluster the first
    one looked at. Higher tiers: every domain's `_bound` first (cheap, from the index), then domains in order of
    (bound, free GPUs, key), each costed (the DP only where its greedy fill misses its bound) until the next bound
    cannot beat the best found.
    """
    if len(fitting) == 1 or (level > 1 and not capacity.is_tree):
        return min(fitting)  # child statistics need a tree; a switch under two parents keeps plain best fit
    objective = objective or _Objective(_IndexView(capacity, g), need)
    if level == 1:
        bound = -(-need // max(1, largest // g))
        best: tuple[int, int, str] | None = None
        heap = list(fitting)  # best fit first, popped one by one: the loop mostly stops at the first
        heapify(heap)
        while heap:
            free, key = heappop(heap)
            cost = _domain_cost(objective, 1, key)
            if best is None or cost < best[0]:
                best = (cost, free, key)
                if cost <= bound:
                    break
        assert best is not None  # fitting has two domains or more: the loop ran
        return best[1], best[2]
    ranked = sorted((_bound(objective, level, key, need), free, key) for free, key in fitting)
    best = None
    for low, free, key in ranked:
        if best is not None and (low, free, key) >= best:
            break  # neither this domain nor any after it can beat the best
        cost = _domain_cost(objective, level, key, low)
        best = min(best or (cost, free, key), (cost, free, key))
    assert best is not None  # ranked is not empty, and its first domain always sets best
    return best[1], best[2]


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
    reason = f"{placement.reason}; no single {request.preferred_tier} (preferred_tier) holds it now"
    return Placement(placement.job_id, placement.replicas, placement.tier, placement.domains, placement.score, reason)


def _order_and_pick(kids: list[_Kid[_H]], need: int) -> tuple[list[tuple[_Kid[_H], int]], _Kid[_H], int]:
    """Fullest children first; the remainder goes to the tightest child that holds all of it.

    `kids`: (key, slots, free GPUs, handle) each. Returns the children taken whole (kid, replicas), the child that
    takes the remainder, and the remainder. Sorted once, so the children that could take the whole remainder are
    always a prefix of what is left.
    """
    order = sorted(kids, key=lambda kid: (-kid[1], kid[2], kid[0]))
    whole: list[tuple[_Kid[_H], int]] = []
    remaining = need
    for i, kid in enumerate(order):
        if kid[1] >= remaining:
            best = kid
            for other in order[i + 1 :]:
                if other[1] < remaining:
                    break
                if (other[2], other[0]) < (best[2], best[0]):
                    best = other
            return whole, best, remaining
        whole.append((kid, kid[1]))
        remaining -= kid[1]
    raise AssertionError("the domain was chosen because it holds the gang")


def _take_indexed(
    capacity: ClusterCapacity, level: int, key: str, need: int, g: int, objective: _Objective[str] | None = None
) -> list[tuple[NodeCapacity, int]]:
    """`_take` read from the capacity index: only the children of chosen domains (and, where lower levels must be
    weighed, their descendants' slot counts) are looked at, not every node of the domain."""
    if level == 0:
        return [(capacity.nodes[key], need)]
    out: list[tuple[NodeCapacity, int]] = []
    objective = objective or _Objective(_IndexView(capacity, g), need)
    objective.left = objective.budget.take_cells
    _plan(objective, level, key, need, out)
    return out


def _take(
    nodes: list[NodeCapacity], need: int, g: int, level: int, budget: _Budget | None = None
) -> list[tuple[NodeCapacity, int]]:
    """Choose `need` replica slots among `nodes` (all inside one domain of `level`): the cheapest placement of
    `_Objective` (fewest children, then fewest domains of each level below), best fit among equals.

    The scan version, for fabrics whose domains do not form a tree (a switch under two parents); it makes the
    same choices as `_take_indexed` on a tree."""
    if level == 0:
        (node,) = nodes
        return [(node, need)]
    out: list[tuple[NodeCapacity, int]] = []
    _plan(_Objective(_ScanView(g), need, budget), level, _Group(nodes), need, out)
    return out


def _scan_cost(nodes: list[NodeCapacity], need: int, g: int, level: int, budget: _Budget | None = None) -> int:
    """What `_fewest_children` ranks a domain by (the cost of its cheapest placement), from its member nodes."""
    return _domain_cost(_Objective(_ScanView(g), need, budget), level, _Group(nodes))


# ---- the objective inside a domain ---------------------------------------------------------------------------
#
# A placement inside a domain of level L costs sum over l < L of (domains of level l it uses) * W**l, W = R + 1: no
# level uses more than R domains, so comparing costs compares (children used, grandchildren used, ..., nodes used)
# lexicographically, the objective's order. Recursively, holding k replicas in domain D costs
#     F_D(k) = min over k = sum k_c of  sum over the children c with k_c > 0 of  W**(L-1) + F_c(k_c),   F_node = 0,
# a knapsack over the children. F_c is a non-decreasing step function; only the top of each step ("breakpoint":
# the most replicas c holds at that cost) is worth offering, and in a cheapest placement every child but one sits
# on a breakpoint, so a covering DP over (replicas covered, capped at k) with the breakpoints as options is exact.
# What keeps it small (and the empty or uniform cases off the DP entirely):
# - The greedy first: fullest children whole, the remainder into the tightest child that holds it. Its cost is
#   compared with a lower bound (`_bound`: at each level, the fewest descendants of that level that hold k, parents
#   ignored; `_lower` for a whole F table); where they meet, the greedy is optimal and no DP runs. They always meet
#   when the children are atoms (leaves over nodes; or when no node holds two replicas, since every placement then
#   uses exactly k nodes and nodes are left out of the DP, `lo` = 1), and in empty or uniform subtrees.
# - Children are described by their shape (the sorted shapes of their own children, slot counts at the bottom),
#   so F is computed once per distinct shape and memoised for the placement; a class of identical children is
#   offered at most m times, m the fewest children that hold k.
# - A cheapest placement uses exactly m children, so only children that can be one of m that hold k take part,
#   and each only with breakpoints of at least k minus what the m-1 largest others hold.
# - Bounds (`_Budget`). Work, in DP cells as if nothing were memoised (pure functions of the shapes, so the indexed
#   and the scan take decide alike, and a placement is reproducible): no DP with its F tables over _EXACT_CELLS,
#   and no more than _TAKE_CELLS for one take. Time: `placement_budget_ms` (ClusterCapacity, set by decide from
#   DecideConfig; the scheduler's --placement-budget-ms), read every _CLOCK_EVERY cells of a DP, so a search ends
#   within about a millisecond of its budget, plus the work outside the DPs (index reads, the greedy, building the
#   placement: linear in the nodes the gang uses). Past either the greedy is kept: F is the greedy fill's, the
#   take `_order_and_pick`'s. Both still use the fewest children (and the tier is read from the index); only the
#   lower levels may then be above the optimum, and the placement's reason says which bound stopped the search.
#   The work bound is where the gap to the unbounded search closes in bench/placement_optimality.py (2,048 nodes,
#   large gangs: 0 of 44 placed worse at 2,000,000 cells, 5 at 200,000, 10 at the old 20,000); the time budget is
#   a safety net several times above what that search takes, so it rarely decides (see README.md, Benchmarks).
#   The tests' clusters stay far below both.
# Best fit among placements of equal cost: the domain with the least free GPUs (`_fewest_children`); inside one,
# where the greedy is optimal, its rule (fullest whole, the remainder into the tightest child that holds it); where
# the DP runs, the least total free GPUs on the children used (its last digit).

_EXACT_CELLS = 2_000_000
_TAKE_CELLS = 3 * _EXACT_CELLS
_CLOCK_EVERY = 20_000  # DP cells between two looks at the clock (a few hundred microseconds of work)
_NEVER = float("inf")
_INT_NEVER = 1 << 62  # `_cover_array`'s unreachable state: finite costs stay below it, sums of two below 2**63
_NUMPY_FROM = 96  # replicas from which `_cover` runs on arrays
# A stage of `_cover`: the least cost per state, a list (inf: unreachable) or an int64 array.
_Stage = list[float] | NDArray[np.int64]

# A domain as a view hands it out: its key on `_IndexView`, its member nodes (`_Group`) on `_ScanView`.
_H = TypeVar("_H")
# A child of a domain: (key, slots, free GPUs, handle).
_Kid = tuple[str, int, int, _H]
# A domain's shape (`_sig`): its slots at the lowest level counted, above it the sorted tuple of its children's
# shapes (at level 1 with nodes counted, the nodes' slot counts). Which it is follows from the level alone.
_Sig = int | tuple["_Sig", ...]
# What `_eligible` and `_select` read of a child: its slots second; `_select`'s also carry free GPUs third and
# their shape fifth ((key, slots, free, handle, shape); key and handle None where only the cost is wanted).
_Slotted = TypeVar("_Slotted", bound=tuple[object, int, object, object] | tuple[object, int, object, object, object])
_Shaped = TypeVar("_Shaped", bound=tuple[str | None, int, int, object, _Sig])


class _View(Protocol[_H]):
    """What the objective reads of a fabric: `_IndexView` (domains by key) or `_ScanView` (groups of nodes)."""

    def kids(self, level: int, handle: _H, /) -> list[_Kid[_H]]: ...

    def node_slots(self, level: int, handle: _H, /) -> tuple[int, ...]: ...

    def most_slots(self, level: int, handle: _H, /) -> int: ...

    def node(self, handle: _H, /) -> NodeCapacity: ...


class _Group:
    """A domain of the scan view: its member nodes (hashable by identity, for the memos)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[NodeCapacity]) -> None:
        self.nodes = nodes


class _IndexView:
    """Domains of a tree read from the capacity index; a domain is its key."""

    def __init__(self, capacity: ClusterCapacity, g: int) -> None:
        self.capacity, self.g = capacity, g
        self._kids: dict[tuple[int, str], list[tuple[str, int, int, str]]] = {}
        self._slots: dict[tuple[int, str], tuple[int, ...]] = {}

    def kids(self, level: int, key: str) -> list[tuple[str, int, int, str]]:
        """(key, slots, free GPUs, handle) of every child that holds a replica (in no particular order)."""
        got = self._kids.get((level, key))
        if got is None:
            stats = self.capacity.child_stats(level, key, self.g)
            got = self._kids[(level, key)] = [(k, s, f, k) for k, (s, f) in stats.items()]
        return got

    def node_slots(self, level: int, key: str) -> tuple[int, ...]:
        got = self._slots.get((level, key))
        if got is None:
            got = self._slots[(level, key)] = self.capacity.node_slots(level, key, self.g)
        return got

    def most_slots(self, level: int, key: str) -> int:
        return self.capacity.most_slots(level, key, self.g)

    def node(self, key: str) -> NodeCapacity:
        return self.capacity.nodes[key]


class _ScanView:
    """Domains as groups of member nodes, split by their key one level down: any fabric, no index."""

    def __init__(self, g: int) -> None:
        self.g = g
        self._kids: dict[tuple[int, _Group], list[tuple[str, int, int, _Group]]] = {}

    def kids(self, level: int, group: _Group) -> list[tuple[str, int, int, _Group]]:
        got = self._kids.get((level, group))
        if got is None:
            parts: dict[str, list[NodeCapacity]] = {}
            for node in group.nodes:
                if node.slots(self.g):
                    parts.setdefault(_key(node, level - 1), []).append(node)
            got = self._kids[(level, group)] = [
                (k, sum(n.slots(self.g) for n in ns), sum(len(n.free) for n in ns), _Group(ns))
                for k, ns in parts.items()
            ]
        return got

    def node_slots(self, level: int, group: _Group) -> tuple[int, ...]:
        return tuple(sorted(s for s in (n.slots(self.g) for n in group.nodes) if s))

    def most_slots(self, level: int, group: _Group) -> int:
        return max((n.slots(self.g) for n in group.nodes), default=0)

    def node(self, group: _Group) -> NodeCapacity:
        (node,) = group.nodes
        return node


class _Budget:
    """What one placement's exact search may spend: DP cells per knapsack (`cells`, deterministic) and per take
    (`take_cells`), and time (`budget_ms`, 0: none; the clock is read once per _CLOCK_EVERY cells, so it costs
    nothing measurable). `stopped`: the time ran out (every DP after that keeps the greedy fill); `capped`: a DP
    was refused by the cell bounds (a greedy fill kept where it might not be optimal)."""

    __slots__ = ("budget_ms", "cells", "take_cells", "deadline", "timed", "left", "stopped", "capped", "spent")

    def __init__(self, budget_ms: float = 0.0, cells: int | None = None) -> None:
        self.budget_ms = budget_ms
        self.cells = _EXACT_CELLS if cells is None else cells
        self.take_cells = _TAKE_CELLS if cells is None else 3 * cells
        self.deadline = perf_counter() + budget_ms / 1e3 if budget_ms > 0 else inf
        self.timed = self if budget_ms > 0 else None  # what `_cover` is handed: None, no clock to read
        self.left = _CLOCK_EVERY
        self.stopped = self.capped = False
        self.spent = 0  # DP cells actually computed (memoised work not counted twice)

    def spend(self, cells: int) -> bool:
        """Count `cells` of DP work; False once the time budget is spent (then `stopped` stays set)."""
        self.left -= cells
        if self.left > 0:
            return True
        self.left = _CLOCK_EVERY
        if perf_counter() > self.deadline:
            self.stopped = True
        return not self.stopped

    def note(self) -> str:
        """What the reason says of a search that kept its heuristic somewhere."""
        if self.stopped:
            why = f"stopped at its {self.budget_ms:g} ms budget"
        else:
            why = f"past its bound of {self.cells:,} DP cells"
        return f"(exact search {why}: heuristic fill, may span more switches or nodes than needed)"


class _Objective(Generic[_H]):
    """Memos for one gang size on one view: signatures, F tables and domain costs (pure functions of shape)."""

    def __init__(self, view: _View[_H], need: int, budget: _Budget | None = None) -> None:
        self.view, self.need, self.w = view, need, need + 1
        self.budget = budget or _Budget()
        self.left = self.budget.take_cells  # what one take may still spend on DPs (`_plan`)
        self.sigs: dict[tuple[int, int, _H], _Sig] = {}  # (lo, level, handle) -> shape
        self.fns: dict[tuple[int, int, _Sig], tuple[list[int], int]] = {}  # (lo, level, shape) -> (F table, work)
        self.costs: dict[tuple[int, int, _Sig], int] = {}  # (lo, level, shape) -> cheapest cost
        self.sizes: dict[tuple[_Sig, ...], int] = {}  # shape -> slots

    def unit(self, level: int) -> int:
        unit: int = self.w**level  # int ** int is typed Any (a negative power is a float); level is never < 0
        return unit


def _lowest(objective: _Objective[_H], level: int, handle: _H) -> int:
    """The lowest level the DP counts inside a domain: 1 when no node holds two replicas (then every placement
    uses exactly k nodes), else 0."""
    return 0 if objective.view.most_slots(level, handle) >= 2 else 1


def _sig(objective: _Objective[_H], level: int, handle: _H, slots: int, lo: int) -> _Sig:
    """The shape of a domain as far as the objective sees it: its slots at level `lo`, above it the sorted tuple of
    its children's shapes (nodes' slot counts for a leaf)."""
    if level <= lo:
        return slots
    memo = (lo, level, handle)
    got = objective.sigs.get(memo)
    if got is None:
        if level == 1:
            got = objective.view.node_slots(1, handle)
        else:
            kids = objective.view.kids(level, handle)
            got = tuple(sorted(_sig(objective, level - 1, h, s, lo) for _, s, _, h in kids))
        objective.sigs[memo] = got
    return got


def _size(objective: _Objective[_H], sig: _Sig) -> int:
    if isinstance(sig, int):
        return sig
    got = objective.sizes.get(sig)
    if got is None:
        got = objective.sizes[sig] = sum(_size(objective, c) for c in sig)
    return got


def _fewest(sizes: Sequence[int], need: int) -> int:
    """How many of these (sorted largest first) hold `need` together."""
    count = held = 0
    for s in sizes:
        count += 1
        held += s
        if held >= need:
            break
    return count


def _steps(table: list[int], unit: int, least: int = 1) -> list[tuple[int, int]]:
    """The breakpoints of a child's F table from `least` replicas on, as (replicas, cost of using the child)."""
    last = len(table) - 1
    return [(b, unit + table[b]) for b in range(max(1, least), last + 1) if b == last or table[b + 1] != table[b]]


def _cover(
    options: list[list[tuple[int, int]]], n: int, clock: _Budget | None = None, keep: bool = True
) -> list[_Stage] | None:
    """Covering DP: stage i, state s = the least cost of holding s replicas (or more) with the first i children,
    each taking at most one of its (replicas, cost) options. Returns every stage (for the backtrack; `keep` False:
    only the last); None when `clock` (a time budget) ran out on the way.

    Large ones run on numpy int64 arrays (exact: every finite cost, a sum of at most one option per child, is below
    the sentinel, itself far from overflow), small ones on lists, where numpy's per-call cost would dominate; both
    compute the same integers."""
    if n >= _NUMPY_FROM and sum(max(w for _, w in opts) for opts in options if opts) < _INT_NEVER:
        return _cover_array(options, n, clock, keep)
    a: list[float] = [0] + [_NEVER] * n
    stages: list[_Stage] = [a]
    for opts in options:
        if clock is not None and not clock.spend((n + 1) * len(opts)):
            return None
        b = a[:]
        for took, w in opts:
            # Every stage is non-decreasing in s, so the states an option improves are a suffix of each range.
            took = min(took, n)
            first = bisect_right(b, w, 1, took + 1)  # from state 0: states 1..took at cost w
            if first <= took:
                b[first : took + 1] = [w] * (took + 1 - first)
            if took < n:  # from states s - took >= 1, at cost a[s - took] + w >= a[1] + w
                start = bisect_right(b, a[1] + w, took + 1)
                if start <= n:
                    b[start:] = [x if x <= (y := z + w) else y for x, z in zip(b[start:], a[start - took :])]
        a = b
        if keep:
            stages.append(a)
    return stages if keep else [a]


def _cover_array(
    options: list[list[tuple[int, int]]], n: int, clock: _Budget | None, keep: bool
) -> list[_Stage] | None:
    """`_cover` on int64 arrays, `_INT_NEVER` for unreachable states."""
    a = np.full(n + 1, _INT_NEVER, dtype=np.int64)
    a[0] = 0
    stages: list[_Stage] = [a]
    minimum = np.minimum
    for opts in options:
        if clock is not None and not clock.spend((n + 1) * len(opts)):
            return None
        b = a.copy()
        for took, w in opts:
            took = min(took, n)
            head = b[1 : took + 1]  # from state 0: states 1..took at cost w
            minimum(head, w, out=head)
            if took < n:  # from states s - took >= 1
                tail = b[took + 1 :]
                minimum(tail, a[1 : n + 1 - took] + w, out=tail)
        a = b
        if keep:
            stages.append(a)
    return stages if keep else [a]


def _ints(stage: _Stage) -> list[int]:
    """A stage of `_cover` (every state reachable) as a list of ints."""
    if isinstance(stage, np.ndarray):
        got: list[int] = stage.tolist()
        return got
    return [int(x) for x in stage]


def _fn(objective: _Objective[_H], level: int, sig: _Sig, lo: int) -> tuple[list[int], int]:
    """F[k] for k = 0 .. min(R, slots): the least cost of levels lo .. level-1 for k replicas in a domain of this
    shape (see the comment above `_EXACT_CELLS`), and the work it took (DP cells, as if nothing were memoised:
    a pure function of the shape, so the budget decisions below do not depend on what was computed before)."""
    memo = (lo, level, sig)
    got = objective.fns.get(memo)
    if got is not None:
        return got
    # Every caller asks about a domain above `lo` (level > lo), whose shape is the tuple of its children's.
    assert isinstance(sig, tuple)
    n = min(objective.need, _size(objective, sig))
    unit = objective.unit(level - 1)
    table = [0] * (n + 1)
    work = n
    if level - 1 <= lo:  # children are atoms (sig: their slots, ascending): the fewest children is a greedy prefix
        held = count = 0
        for s in reversed(cast("tuple[int, ...]", sig)):  # the children, at level lo, are slot counts
            count += 1
            upto = min(held + s, n)
            table[held + 1 : upto + 1] = [count * unit] * (upto - held)
            held = upto
            if held >= n:
                break
        objective.fns[memo] = table, work
        return table, work
    kinds: dict[_Sig, int] = {}  # child shape -> how many children have it, fullest shapes first
    for child in sorted(sig, key=lambda c: _size(objective, c), reverse=True):
        kinds[child] = kinds.get(child, 0) + 1
    tables = {}
    # The greedy fill, fullest children first: exact wherever it meets the lower bound (empty or uniform shapes).
    held, base = 0, 0
    for child, count in kinds.items():
        tables[child], cost = _fn(objective, level - 1, child, lo)
        work += cost
        sub = tables[child]
        for _ in range(count):
            upto = min(held + len(sub) - 1, n)
            table[held + 1 : upto + 1] = [base + unit + sub[k] for k in range(1, upto - held + 1)]
            base += unit + sub[upto - held]
            held = upto
            if held >= n:
                break
        if held >= n:
            break
    if table == _lower(objective, level, sig, lo, n):
        objective.fns[memo] = table, work
        return table, work
    m = _fewest([_size(objective, c) for c in kinds for _ in range(kinds[c])], n)
    copies = sum(min(count, m) for count in kinds.values())
    budget = objective.budget
    limit = budget.cells
    exact = False
    if (n + 1) * copies <= limit and not budget.stopped:  # else too big whatever the tables say
        options = []
        for child, count in kinds.items():
            if child not in tables:
                tables[child], cost = _fn(objective, level - 1, child, lo)
                work += cost
                if work > limit:
                    break
            options += [_steps(tables[child], unit)] * min(count, m)
        cells = (n + 1) * sum(map(len, options))
        if len(tables) == len(kinds) and work + cells <= limit:
            stages = _cover(options, n, budget.timed, keep=False)
            if stages is not None:
                table = _ints(stages[-1])
                budget.spent += cells
                exact = True
            work += cells
    if not exact and not budget.stopped:
        budget.capped = True
    objective.fns[memo] = table, work  # the DP's, or (too big, or out of time) the greedy fill's: an upper bound
    return table, work


def _lower(objective: _Objective[_H], level: int, sig: tuple[_Sig, ...], lo: int, n: int) -> list[int]:
    """A lower bound of F[k] for every k: at each level, the fewest descendants of that level that hold k."""
    table = [0] * (n + 1)
    layer = list(sig)
    for lv in range(level - 1, lo - 1, -1):
        unit, held, count = objective.unit(lv), 0, 0
        for s in sorted((_size(objective, c) for c in layer), reverse=True):
            count += 1
            upto = min(held + s, n)
            table[held + 1 : upto + 1] = [x + count * unit for x in table[held + 1 : upto + 1]]
            held = upto
            if held >= n:
                break
        if lv > lo:  # the shapes of level lv > lo are tuples of their children's
            layer = [c for shape in cast("list[tuple[_Sig, ...]]", layer) for c in shape]
    return table


def _eligible(kids: Sequence[_Slotted], need: int) -> tuple[int, list[tuple[_Slotted, int]]]:
    """m, the fewest of `kids` (as (key, slots, ...)) that hold `need` together, and the kids that can be one of m
    that do, each with the least it must then take (what the m-1 largest others cannot)."""
    sizes = sorted((kid[1] for kid in kids), reverse=True)
    m = _fewest(sizes, need)
    top = sum(sizes[: m - 1])  # what the m-1 largest hold
    out = []
    for kid in kids:
        s = kid[1]
        if m > 1 and s >= sizes[m - 2]:
            least = need - (top - s + sizes[m - 1])  # it may be one of the m-1 largest
        else:
            least = need - top
            if s < least:
                continue  # no m children that hold the gang include it
        out.append((kid, max(1, least)))
    return m, out


def _select(
    objective: _Objective[_H],
    level: int,
    kids: Sequence[_Shaped],
    need: int,
    lo: int,
    tie: bool,
) -> tuple[int, list[tuple[_Shaped, int]]] | None:
    """The cheapest way to hold `need` replicas on `kids` (children of one domain of `level`, as (key, slots, free,
    handle, shape)): (cost, [(kid, replicas)]), or None when the DP (with the F tables it needs) would be too big.

    `tie`: best fit among equal costs, the least free GPUs on the children used (a last digit of the cost; the
    DP tries the tightest children first, so with equal costs the tightest one also takes the remainder)."""
    budget = objective.budget
    if budget.stopped:
        return None
    unit = objective.unit(level - 1)
    m, eligible = _eligible(sorted(kids, key=lambda kid: (kid[2], kid[0])) if tie else kids, need)
    limit = min(budget.cells, objective.left) if tie else budget.cells
    if (need + 1) * len(eligible) > limit:
        budget.capped = True
        return None  # at least one option a child: too big whatever the tables say
    chosen: list[tuple[_Shaped, list[tuple[int, int]]]] = []  # (kid, its (replicas, cost) options)
    seen: dict[_Sig | tuple[_Sig, int], int] = {}  # kind of child (shape; with tie, (shape, free)) -> offered
    charged: set[_Sig] = set()
    work = 0
    for kid, least in eligible:
        cls = (kid[4], kid[2]) if tie else kid[4]
        if seen.get(cls, 0) >= m:
            continue  # m of the same kind are enough
        seen[cls] = seen.get(cls, 0) + 1
        if level - 1 <= lo:
            opts = [(min(kid[1], need), unit)]
        else:
            table, cost = _fn(objective, level - 1, kid[4], lo)
            if kid[4] not in charged:
                charged.add(kid[4])
                work += cost
                if work > limit:
                    budget.capped |= not budget.stopped
                    return None
            opts = _steps(table, unit, least)
        chosen.append((kid, opts))
    scale = sum(kid[2] for kid, _ in chosen) + 1 if tie else 1
    options = [[(b, w * scale + (kid[2] if tie else 0)) for b, w in opts] for kid, opts in chosen]
    cells = (need + 1) * sum(map(len, options))
    work += cells
    if work > limit:
        budget.capped |= not budget.stopped
        return None
    if tie:
        objective.left -= work
    got = _cover(options, need, budget.timed)
    if got is None:
        return None  # out of time
    budget.spent += cells
    stages = got
    scaled = stages[-1][need]
    picks: list[tuple[_Shaped, int]] = []
    s = need
    for i in range(len(options) - 1, -1, -1):
        if s == 0:
            break
        now, before = stages[i + 1], stages[i]
        if now[s] == before[s]:
            continue
        for b, w in options[i]:
            if before[max(0, s - b)] + w == now[s]:
                took = min(b, s)
                picks.append((chosen[i][0], took))
                s -= took
                break
    return int(scaled) // scale, picks


def _bound(objective: _Objective[_H], level: int, handle: _H, need: int) -> int:
    """A lower bound of the cheapest placement's cost inside a domain: the fewest children (exact), then at every
    level below, the fewest descendants of that level of the children that can be among the fewest, whatever their
    parents (a greedy count each), for `need` replicas. A placement that reaches it is optimal; exact when the
    children are atoms."""
    view = objective.view
    m, eligible = _eligible(view.kids(level, handle), need)
    total = m * objective.unit(level - 1)
    if level == 1:
        return total
    lo = _lowest(objective, level, handle)
    frontier = [kid for kid, _ in eligible]
    for lv in range(level - 2, 0, -1):
        frontier = [kid for parent in frontier for kid in view.kids(lv + 1, parent[3])]
        total += _fewest(sorted((kid[1] for kid in frontier), reverse=True), need) * objective.unit(lv)
    if lo == 1:
        return total + need  # no node holds two replicas: every placement uses `need` nodes
    nodes = sorted((s for kid, _ in eligible for s in view.node_slots(level - 1, kid[3])), reverse=True)
    return total + _fewest(nodes, need)


def _greedy_cost(objective: _Objective[_H], level: int, shapes: list[tuple[_Sig, int]], lo: int) -> int:
    """The cost of children taken as (shape, replicas), lower levels at their best (levels down to `lo`)."""
    unit, need = objective.unit(level - 1), 0
    cost = 0
    for sig, took in shapes:
        need += took
        cost += unit + (_fn(objective, level - 1, sig, lo)[0][took] if level - 1 > lo else 0)
    return cost + (need if lo == 1 else 0)


def _domain_cost(objective: _Objective[_H], level: int, handle: _H, bound: int | None = None) -> int:
    """The cost of the cheapest placement of the gang inside this domain (it holds the gang); `bound`: its
    `_bound`, if known. Exact unless the DP would be too big (then the greedy fill's cost, an upper bound)."""
    need = objective.need
    if level == 1:
        return _fewest(objective.view.node_slots(1, handle)[::-1], need)
    lo = _lowest(objective, level, handle)
    sig = _sig(objective, level, handle, 0, lo)
    memo = (lo, level, sig)
    cost = objective.costs.get(memo)
    if cost is None:
        assert isinstance(sig, tuple)  # level >= 2 > lo: the shape is the tuple of the children's
        # The greedy fill (fullest children first); exact when the children are atoms or it reaches the bound.
        fill, held = [], 0
        for child in sorted(sig, key=lambda c: _size(objective, c), reverse=True):
            took = min(_size(objective, child), need - held)
            fill.append((child, took))
            held += took
            if held >= need:
                break
        cost = _greedy_cost(objective, level, fill, lo)
        if level - 1 > lo and cost != (_bound(objective, level, handle, need) if bound is None else bound):
            kids = [(None, _size(objective, c), 0, None, c) for c in sig]
            got = _select(objective, level, kids, need, lo, tie=False)
            if got is not None:
                cost = got[0] + (need if lo == 1 else 0)
        objective.costs[memo] = cost
    return cost


def _plan(objective: _Objective[_H], level: int, handle: _H, need: int, out: list[tuple[NodeCapacity, int]]) -> None:
    """Append the nodes (and replicas on each) of the cheapest placement of `need` replicas inside a domain."""
    if level == 0:
        out.append((objective.view.node(handle), need))
        return
    kids = objective.view.kids(level, handle)
    # Fullest children whole, the remainder into the tightest child that holds it: the fewest children, and all the
    # objective asks when the children are atoms (or when it reaches the lower bound at every level).
    whole, last, remaining = _order_and_pick(kids, need)
    picks = [(kid[3], took) for kid, took in whole]
    picks.append((last[3], remaining))
    if level == 1:
        node = objective.view.node
        out += [(node(h), took) for h, took in picks]
        return
    lo = _lowest(objective, level, handle)
    if level - 1 > lo:  # lower levels to weigh: keep the greedy only where it meets the lower bound
        shape = {h: _sig(objective, level - 1, h, s, lo) for _, s, _, h in kids}
        greedy = _greedy_cost(objective, level, [(shape[h], took) for h, took in picks], lo)
        if greedy != _bound(objective, level, handle, need):
            got = _select(objective, level, [(*kid, shape[kid[3]]) for kid in kids], need, lo, tie=True)
            if got is not None:
                picks = [(kid[3], took) for kid, took in got[1]]
    for child, took in picks:
        _plan(objective, level - 1, child, took, out)


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


_QUEUE_ORDER = operator.attrgetter("order")


def queue_order(pending: Sequence[GangRequest]) -> list[GangRequest]:
    """Priority (higher first), then submission time, then id: the order every replica agrees on."""
    return sorted(pending, key=_QUEUE_ORDER)
