"""What a placement's ring AllReduce traffic crosses: leaves, spines and, on rail-optimized fabrics, rails.

The ring follows rank order: the ranks of one node are contiguous (their hops stay on NVLink), and each change of
node, plus the wrap-around from the last rank to the first, is one inter-node hop. NCCL runs one ring channel per
local rank: the hop from node A to node B carries local rank k's traffic from A's k-th GPU to B's k-th GPU.

- Classic tree (`Fabric.rails == 0`): a hop between nodes under one leaf stays on that leaf switch; between leaves
  it goes up to the spine; between spines, above them.
- Rail-optimized (`Fabric.rails == N`, the DGX SuperPOD design): GPU i's NIC sits on rail switch i mod N of its
  scalable unit (the leaf domain). A hop whose channels stay on their rails (A's k-th GPU and B's k-th GPU on the
  same rail) and inside one unit is one switch hop; a channel that changes rails goes up to the spine even inside
  one unit. That is why placement keeps local rank i on GPU i on every node (rail alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fabric import Fabric
from .model import Placement


@dataclass(frozen=True, slots=True)
class RingCost:
    tier: str  # highest tier the gang crosses ("node" inside one node)
    leaves: int  # leaf switches (scalable units on a rail-optimized fabric) spanned; 1 inside one leaf
    leaf_crossings: int  # inter-node ring hops between nodes under different leaves (up to a spine)
    spine_crossings: int  # inter-node ring hops between nodes under different spines (above the spines)
    rails: tuple[int, ...]  # rails the inter-node traffic uses (rail-optimized fabrics only)
    rail_changes: int  # hops inside one leaf domain with a channel that changes rail (up to a spine)

    def to_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "leaves": self.leaves,
            "leaf_crossings": self.leaf_crossings,
            "spine_crossings": self.spine_crossings,
            "rails": list(self.rails),
            "rail_changes": self.rail_changes,
        }


def ring_cost(placement: Placement, fabric: Fabric) -> RingCost:
    replicas = sorted(placement.replicas, key=lambda r: r.replica)
    nodes = [r.node for r in replicas]

    def switch(node: str, tier: int) -> str | None:
        path = fabric.switch_path(node)
        return path[tier] if tier < len(path) else None

    leaves = {switch(n, 0) or n for n in nodes}
    hops = []
    distinct = len(set(nodes))
    if distinct > 1:
        for i, rep in enumerate(replicas):
            nxt = replicas[(i + 1) % len(replicas)]
            if nxt.node != rep.node:
                hops.append((rep, nxt))
    leaf_x = spine_x = rail_x = 0
    rails: set[int] = set()
    for a, b in hops:
        same_leaf = switch(a.node, 0) == switch(b.node, 0)
        leaf_x += not same_leaf
        spine_x += switch(a.node, 1) != switch(b.node, 1) if len(fabric.switch_tiers) >= 2 else 0
        if fabric.rails:
            ra = [g % fabric.rails for g in a.gpus]
            rb = [g % fabric.rails for g in b.gpus]
            rails.update(ra)
            rails.update(rb)
            if same_leaf and ra != rb:
                rail_x += 1
    return RingCost(placement.tier, len(leaves), leaf_x, spine_x, tuple(sorted(rails)), rail_x)
