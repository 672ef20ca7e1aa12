"""The covering knapsack of the exact search (`_cover`): the least cost of holding s replicas with the first i
children, each taking at most one of its (replicas, cost) options. On lists for small gangs, on int64 arrays from
`_NUMPY_FROM` replicas on: both compute the same integers."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
from numpy.typing import NDArray

from .budget import _Budget

_NEVER = float("inf")
_INT_NEVER = 1 << 62  # `_cover_array`'s unreachable state: finite costs stay below it, sums of two below 2**63
_NUMPY_FROM = 96  # replicas from which `_cover` runs on arrays
# A stage of `_cover`: the least cost per state, a list (inf: unreachable) or an int64 array.
_Stage = list[float] | NDArray[np.int64]


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
