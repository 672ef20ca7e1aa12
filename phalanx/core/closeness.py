"""How close each pair of GPUs of one node is, from its per-pair `nvidia-smi topo -m` cells.

Pure. `GpuCloseness` holds a symmetric rank matrix indexed by GPU index (the N of "GPUN"), ranks from
`topo_dump.link_rank`: higher is closer (NV18 > NV12 > ... > NV1 > PIX > PXB > PHB > NODE > SYS > unknown).
Closeness is always judged per pair, never from a per-node flag: a GPU whose NVLinks are down has non-NV cells
to its peers and ranks as PCIe-connected to them, whatever its model.

Built from a parsed dump (`from_dump`), from the topology a node agent registered (`from_topology`: the
HostTopology proto as a dict, `{"matrix": {"GPU0": {"cells": {"GPU1": "NV18", ...}}, ...}}`), or from any
`cell(a, b)` function (`from_matrix`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from typing import Any

from .topo_dump import TopoDump, link_rank

_GPU_RE = re.compile(r"^GPU(\d+)$")


@dataclass(frozen=True, slots=True)
class GpuCloseness:
    """ranks[a][b]: closeness of GPU a and GPU b (0 when unknown; the diagonal is 0 too, it is never used).

    `uniform`: every known pair has the same rank (a DGX H100: all NV18), so closeness cannot tell choices apart.
    """

    ranks: tuple[tuple[int, ...], ...]
    uniform: bool

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank(self, a: int, b: int) -> int:
        if a == b or a < 0 or b < 0 or a >= len(self.ranks) or b >= len(self.ranks):
            return 0
        return self.ranks[a][b]

    def score(self, gpus: Iterable[int]) -> tuple[int, int]:
        """(worst pairwise rank, sum of pairwise ranks) of a GPU set: higher is closer. One GPU: (max, 0)."""
        gpus = list(gpus)
        if len(gpus) < 2:
            return (1 << 30, 0)
        worst, total = 1 << 30, 0
        for a, b in combinations(gpus, 2):
            r = self.rank(a, b)
            total += r
            if r < worst:
                worst = r
        return worst, total

    @classmethod
    def from_matrix(cls, gpus: list[str], cell: Callable[[str, str], str | None]) -> GpuCloseness:
        """`gpus` are names "GPU0".."GPUn" (others are ignored); `cell(a, b)` their topo cell (None: unknown)."""
        indexed = sorted((int(m.group(1)), g) for g in gpus if (m := _GPU_RE.match(g)))
        cells: list[tuple[int, int, str]] = []
        for (i, a), (j, b) in combinations(indexed, 2):
            value = cell(a, b)
            if value is None:
                value = cell(b, a)
            cells.append((i, j, value or ""))
        size = indexed[-1][0] + 1 if indexed else 0
        return _build(size, tuple(cells))

    @classmethod
    def from_dump(cls, dump: TopoDump) -> GpuCloseness:
        return cls.from_matrix(dump.gpus, dump.cell)

    @classmethod
    def from_topology(cls, topology: Mapping[str, Any] | None) -> GpuCloseness | None:
        """From a registered topology dict (MessageToDict of HostTopology, proto field names); None when it has no
        GPU-to-GPU matrix (a lite agent's topology, an older agent)."""
        if not topology:
            return None
        matrix = topology.get("matrix") or {}
        if not isinstance(matrix, Mapping):
            return None
        rows: dict[str, Mapping[str, Any]] = {}
        names: set[str] = set()
        for name, row in matrix.items():
            if not isinstance(row, Mapping):
                continue
            cells = row.get("cells", row)
            if not isinstance(cells, Mapping):
                continue
            rows[name] = cells
            if _GPU_RE.match(name):
                names.add(name)
                names.update(k for k in cells if _GPU_RE.match(k))
        if len(names) < 2:
            return None

        def cell(a: str, b: str) -> str | None:
            value = rows.get(a, {}).get(b)
            return value if isinstance(value, str) else None

        closeness = cls.from_matrix(sorted(names), cell)
        if not any(r for row in closeness.ranks for r in row):
            return None  # no GPU pair has a known cell: nothing to go by
        return closeness


@lru_cache(maxsize=256)
def _build(size: int, cells: tuple[tuple[int, int, str], ...]) -> GpuCloseness:
    """Cached: a fleet of identical hosts shares one object (and a reload does not re-rank every node)."""
    ranks = [[0] * size for _ in range(size)]
    seen: set[int] = set()
    for i, j, value in cells:
        r = link_rank(value) if value else 0
        ranks[i][j] = ranks[j][i] = r
        seen.add(r)
    return GpuCloseness(tuple(tuple(row) for row in ranks), uniform=len(seen) <= 1)


# Beyond this many candidate sets, placement keeps its index-based choice (nodes here have at most 8 GPUs:
# 8 choose 4 is 70).
MAX_CANDIDATES = 4096


def closest_sets(closeness: GpuCloseness, free: Iterable[int], k: int) -> list[tuple[int, ...]] | None:
    """All `k`-subsets of `free` (sorted tuples) whose (worst pair, pair sum) is the best; None when there are
    too many subsets to try (the caller falls back to its own choice)."""
    ordered = sorted(free)
    n = len(ordered)
    if k < 2 or k >= n:
        return [tuple(ordered[:k])]
    from math import comb

    if comb(n, k) > MAX_CANDIDATES:
        return None
    best: tuple[int, int] | None = None
    sets: list[tuple[int, ...]] = []
    ranks, size = closeness.ranks, closeness.size
    for subset in combinations(ordered, k):
        worst, total = 1 << 30, 0
        for a, b in combinations(subset, 2):
            r = ranks[a][b] if a < size and b < size else 0
            total += r
            if r < worst:
                worst = r
        key = (worst, total)
        if best is None or key > best:
            best, sets = key, [subset]
        elif key == best:
            sets.append(subset)
    return sets


__all__ = ["GpuCloseness", "MAX_CANDIDATES", "closest_sets"]
