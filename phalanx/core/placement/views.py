"""What the search reads of a fabric: a domain's children, their slots and free GPUs, its nodes' slot counts. Two
views answer the same questions: `_IndexView` from the capacity index (a tree of domains, by key), `_ScanView`
from a group of member nodes (any fabric, a switch under two parents included)."""

from __future__ import annotations

from typing import Protocol, TypeVar

from ..capacity import ClusterCapacity
from ..model import NodeCapacity
from .tiers import domain_of

# A domain as a view hands it out: its key on `_IndexView`, its member nodes (`_Group`) on `_ScanView`.
_H = TypeVar("_H")
# A child of a domain: (key, slots, free GPUs, handle).
_Kid = tuple[str, int, int, _H]


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
                    parts.setdefault(domain_of(node, level - 1), []).append(node)
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
