"""The free-capacity view of a cluster that placement reads and reservations update."""

from __future__ import annotations

from collections.abc import Iterable

from .model import NodeCapacity, Placement


class CapacityError(RuntimeError):
    """A reservation or release that does not match the view: a bug or a stale view."""


class ClusterCapacity:
    def __init__(self, nodes: Iterable[NodeCapacity] = ()) -> None:
        self.nodes: dict[str, NodeCapacity] = {n.name: n for n in nodes}
        self._shape: tuple[list[int], int] | None = None

    def add(self, node: NodeCapacity) -> None:
        self.nodes[node.name] = node
        self._shape = None

    def shape(self) -> tuple[list[int], int]:
        """Static shape, cached: the most nodes any domain of each level holds, and the largest node's GPUs.

        Placement skips a level whose largest domain could not hold the gang even when empty.
        """
        if self._shape is None:
            depth = max((len(n.path) for n in self.nodes.values()), default=0)
            most = [1]
            for level in range(1, depth + 2):
                counts: dict[str, int] = {}
                for n in self.nodes.values():
                    key = n.path[level - 1] if level - 1 < len(n.path) else ""
                    counts[key] = counts.get(key, 0) + 1
                most.append(max(counts.values(), default=0))
            self._shape = (most, max((n.total for n in self.nodes.values()), default=0))
        return self._shape

    def free_gpus(self) -> int:
        return sum(len(n.free) for n in self.nodes.values() if n.schedulable)

    def total_gpus(self) -> int:
        return sum(n.total for n in self.nodes.values())

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
            self.nodes[name].free -= gpus

    def release(self, node: str, gpus: Iterable[int]) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        n.free |= {g for g in gpus if 0 <= g < n.total}

    def max_replicas_ever(self, gpus_per_replica: int) -> int:
        """Replicas of this size the whole cluster could hold if empty (drained and lost nodes included)."""
        return sum(n.total // gpus_per_replica for n in self.nodes.values()) if gpus_per_replica > 0 else 0
