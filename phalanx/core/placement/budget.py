"""What one placement's exact search may spend (`_Budget`: DP cells and time), and, in the comment below, the
objective that search computes inside a domain and why its bounds sit where they do."""

from __future__ import annotations

from math import inf
from time import perf_counter

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
#   a safety net several times above what that search takes, so it rarely decides (see docs/benchmarks.md).
#   The tests' clusters stay far below both.
# Best fit among placements of equal cost: the domain with the least free GPUs (`_fewest_children`); inside one,
# where the greedy is optimal, its rule (fullest whole, the remainder into the tightest child that holds it); where
# the DP runs, the least total free GPUs on the children used (its last digit).

_EXACT_CELLS = 2_000_000
_TAKE_CELLS = 3 * _EXACT_CELLS
_CLOCK_EVERY = 20_000  # DP cells between two looks at the clock (a few hundred microseconds of work)


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
