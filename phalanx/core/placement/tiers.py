"""Tier names and levels of a fabric, and the domain of a node at a switch level: what both the search and its
callers (backfill, preemption, the CLI) name domains by. Imports nothing else of the package."""

from __future__ import annotations

from collections.abc import Sequence

from ..capacity import ClusterCapacity
from ..model import NodeCapacity


def tier_names(capacity: ClusterCapacity, fabric_tiers: Sequence[str] = ()) -> list[str]:
    depth = capacity.levels() - 1
    names = list(fabric_tiers[:depth])
    while len(names) < depth:
        names.append(f"tier{len(names)}")
    return ["node", *names, "cluster"]


def domain_of(node: NodeCapacity, level: int) -> str:
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


def domain_members(
    capacity: ClusterCapacity, nodes: Sequence[str], tier: str, fabric_tiers: Sequence[str] = ()
) -> frozenset[str]:
    """Every node in the same domain of `tier` as one of `nodes` (the nodes themselves for "node"; empty for an
    unknown tier, or for "cluster", whose one domain holds everything and so keeps nothing apart)."""
    level = tier_level(capacity, tier, fabric_tiers)
    top = capacity.levels()
    if level is None or level >= top:
        return frozenset()
    if level == 0:
        return frozenset(n for n in nodes if n in capacity.nodes)
    domains = {domain_of(capacity.nodes[n], level) for n in nodes if n in capacity.nodes}
    domains.discard("")
    if not domains:
        return frozenset()
    return frozenset(name for name, node in capacity.nodes.items() if domain_of(node, level) in domains)
