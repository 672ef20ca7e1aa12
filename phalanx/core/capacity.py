"""The free-capacity view of a cluster that placement reads and reservations update.

Static structure (which domain of each tier a node sits in) is built once per set of nodes; free capacity is an
index kept up to date on every reservation and release: for each domain, a histogram of its nodes' free-GPU
counts. "How many replicas of G GPUs does this leaf hold?" is then a sum over at most (GPUs per node + 1)
buckets, not a scan of the leaf's nodes, and the best-fitting single node comes from a bucket of nodes with the
same free count.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

from .model import NodeCapacity, Placement


class CapacityError(RuntimeError):
    """A reservation or release that does not match the view: a bug or a stale view."""


def domain_key(node: NodeCapacity, level: int, top: int) -> str:
    """Domain of `node` at `level`: 0 is the node itself, 1..top-1 its switch of that tier, `top` the cluster."""
    if level == 0:
        return node.name
    if level >= top:
        return ""
    return node.path[level - 1] if level - 1 < len(node.path) else ""


class ClusterCapacity:
    def __init__(self, nodes: Iterable[NodeCapacity] = ()) -> None:
        self.nodes: dict[str, NodeCapacity] = {n.name: n for n in nodes}
        self._built = False

    # ---- structure -------------------------------------------------------------------------------------------

    def add(self, node: NodeCapacity) -> None:
        self.nodes[node.name] = node
        self._built = False

    def _build(self) -> None:
        nodes = list(self.nodes.values())
        self.depth = max((len(n.path) for n in nodes), default=0)
        self.top = self.depth + 1
        self.largest = max((n.total for n in nodes), default=0)
        self._members: list[dict[str, list[NodeCapacity]]] = [{} for _ in range(self.top + 1)]
        self._hist: list[dict[str, list[int]]] = [{} for _ in range(self.top + 1)]
        # Nodes by effective free count, each bucket a sorted list of names (the tightest node is bucket[0]).
        self._by_free: list[list[str]] = [[] for _ in range(self.largest + 1)]
        self._effective: dict[str, int] = {}
        # Child domains (keys of level - 1) of every domain of level >= 2, and whether the domains form a tree
        # (every child domain under exactly one parent); placement walks down the index only on a tree.
        self._children: list[dict[str, list[str]]] = [{} for _ in range(self.top + 1)]
        parent: list[dict[str, str]] = [{} for _ in range(self.top + 1)]
        self.is_tree = True
        for node in nodes:
            eff = min(len(node.free), self.largest) if node.schedulable else 0
            self._effective[node.name] = eff
            self._by_free[eff].append(node.name)
            for level in range(1, self.top + 1):
                key = domain_key(node, level, self.top)
                self._members[level].setdefault(key, []).append(node)
                hist = self._hist[level].get(key)
                if hist is None:
                    hist = self._hist[level][key] = [0] * (self.largest + 1)
                hist[eff] += 1
                if level >= 2:
                    child = domain_key(node, level - 1, self.top)
                    seen = parent[level - 1].setdefault(child, key)
                    if seen != key:
                        self.is_tree = False
                    elif child not in self._children[level].setdefault(key, []):
                        self._children[level][key].append(child)
        for bucket in self._by_free:
            bucket.sort()
        self._built = True
        self.most_nodes = [1] + [max((len(m) for m in self._members[lv].values()), default=0)
                                 for lv in range(1, self.top + 1)]
        self._total = sum(n.total for n in nodes)
        self._ever: dict[int, int] = {}

    def _ensure(self) -> None:
        if not self._built:
            self._build()

    def _changed(self, node: NodeCapacity) -> None:
        """Move a node to the histogram buckets of its current effective free count."""
        if not self._built:
            return
        new = min(len(node.free), self.largest) if node.schedulable else 0
        old = self._effective[node.name]
        if new == old:
            return
        self._effective[node.name] = new
        for level in range(1, self.top + 1):
            hist = self._hist[level][domain_key(node, level, self.top)]
            hist[old] -= 1
            hist[new] += 1
        bucket = self._by_free[old]
        del bucket[bisect_left(bucket, node.name)]
        insort(self._by_free[new], node.name)

    # ---- queries ---------------------------------------------------------------------------------------------

    def shape(self) -> tuple[list[int], int]:
        """The most nodes any domain of each level holds, and the largest node's GPUs."""
        self._ensure()
        return self.most_nodes, self.largest

    def levels(self) -> int:
        """Index of the top (cluster) level: 0 node, 1..depth switch tiers, depth+1 cluster."""
        self._ensure()
        return self.top

    def domain_stats(self, level: int, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
        """For every domain of `level` (>= 1): (replicas of this size it holds now, free GPUs)."""
        self._ensure()
        g = gpus_per_replica
        out = {}
        for key, hist in self._hist[level].items():
            slots = free = 0
            for f in range(1, len(hist)):
                count = hist[f]
                if count:
                    free += f * count
                    slots += (f // g) * count
            out[key] = (slots, free)
        return out

    def members(self, level: int, key: str) -> list[NodeCapacity]:
        self._ensure()
        return self._members[level].get(key, [])

    def tightest_node(self, gpus: int) -> NodeCapacity | None:
        """The schedulable node with the fewest free GPUs that still has `gpus` free (ties: by name)."""
        self._ensure()
        for f in range(max(gpus, 1), self.largest + 1):
            if self._by_free[f]:
                return self.nodes[self._by_free[f][0]]
        return None

    def most_free_on_a_node(self) -> int:
        """The largest effective free count of any node (0 when none is schedulable or free)."""
        self._ensure()
        for f in range(self.largest, 0, -1):
            if self._by_free[f]:
                return f
        return 0

    def effective_free(self, node: str) -> int:
        """Free GPUs of `node` as placement sees them: 0 when it is not schedulable."""
        self._ensure()
        return self._effective.get(node, 0)

    def child_stats(self, level: int, key: str, gpus_per_replica: int) -> dict[str, tuple[int, int]]:
        """For every child of domain `key` of `level` (>= 1) that holds at least one replica of this size:
        (replicas it holds, free GPUs on its nodes that hold a replica). Children of a level-1 domain are nodes.

        Read from the index: O(children x GPUs per node), not a scan of the domain's nodes. Meaningful only when
        `is_tree` (for level >= 2).
        """
        self._ensure()
        g = gpus_per_replica
        out: dict[str, tuple[int, int]] = {}
        if level == 1:
            eff = self._effective
            for node in self._members[1].get(key, ()):
                f = eff[node.name]
                if f >= g:
                    out[node.name] = (f // g, f)
            return out
        hists = self._hist[level - 1]
        for child in self._children[level].get(key, ()):
            hist = hists[child]
            slots = free = 0
            for f in range(g, len(hist)):
                count = hist[f]
                if count:
                    free += f * count
                    slots += (f // g) * count
            if slots:
                out[child] = (slots, free)
        return out

    def free_gpus(self) -> int:
        self._ensure()
        return sum(f * c for hist in self._hist[self.top].values() for f, c in enumerate(hist))

    def total_gpus(self) -> int:
        self._ensure()
        return self._total

    def max_replicas_ever(self, gpus_per_replica: int) -> int:
        """Replicas of this size the whole cluster could hold if empty (drained and lost nodes included)."""
        if gpus_per_replica <= 0:
            return 0
        self._ensure()
        if gpus_per_replica not in self._ever:
            self._ever[gpus_per_replica] = sum(n.total // gpus_per_replica for n in self.nodes.values())
        return self._ever[gpus_per_replica]

    # ---- updates ---------------------------------------------------------------------------------------------

    def reserve(self, placement: Placement) -> None:
        """Take every GPU of the placement, or none (raises CapacityError and changes nothing)."""
        wanted: dict[str, set[int]] = {}
        for rep in placement.replicas:
            node = self.nodes.get(rep.node)
            if node is None:
                raise CapacityError(f"unknown node {rep.node!r}")
            gpus = set(rep.gpus)
            taken = wanted.setdefault(rep.node, set())
            if not gpus <= node.free or gpus & taken:
                raise CapacityError(f"GPUs {sorted(gpus)} of {rep.node} are not free")
            taken |= gpus
        for name, gpus in wanted.items():
            self.take(name, gpus)

    def take(self, node: str, gpus: Iterable[int]) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        n.free -= set(gpus)
        self._changed(n)

    def release(self, node: str, gpus: Iterable[int]) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        n.free |= {g for g in gpus if 0 <= g < n.total}
        self._changed(n)

    def set_schedulable(self, node: str, schedulable: bool) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        n.schedulable = schedulable
        self._changed(n)
