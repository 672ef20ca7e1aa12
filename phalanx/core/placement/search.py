"""The exact search inside a domain: which domain of a tier to take (`_fewest_children`) and how its replicas
spread over its children, recursively down to nodes (`_plan`): the fewest children, then the fewest domains of each
level below, best fit among equals. A greedy fill first, a covering knapsack (`cover._cover`) only where the greedy
misses a lower bound, within the bounds of `budget._Budget`; see the comment in placement/budget.py."""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop
from typing import Generic, TypeVar, cast

from ..capacity import ClusterCapacity
from ..model import NodeCapacity
from .budget import _Budget
from .cover import _cover, _ints, _steps
from .views import _H, _Group, _IndexView, _Kid, _ScanView, _View

# A domain's shape (`_sig`): its slots at the lowest level counted, above it the sorted tuple of its children's
# shapes (at level 1 with nodes counted, the nodes' slot counts). Which it is follows from the level alone.
_Sig = int | tuple["_Sig", ...]
# What `_eligible` and `_select` read of a child: its slots second; `_select`'s also carry free GPUs third and
# their shape fifth ((key, slots, free, handle, shape); key and handle None where only the cost is wanted).
_Slotted = TypeVar("_Slotted", bound=tuple[object, int, object, object] | tuple[object, int, object, object, object])
_Shaped = TypeVar("_Shaped", bound=tuple[str | None, int, int, object, _Sig])


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
