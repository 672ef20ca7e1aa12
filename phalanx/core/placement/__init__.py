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

from .budget import _EXACT_CELLS as _EXACT_CELLS
from .gang import Unplaceable, place_gang, queue_order
from .gpus import _build as _build
from .gpus import pick_gpus
from .search import _scan_cost as _scan_cost
from .search import _take as _take
from .tiers import domain_members, domain_of, tier_level, tier_names

# The private names above are re-exported for the benchmarks (bench/placement_speed.py, placement_optimality.py),
# which compare the search with its scan version and report its default bound.
__all__ = [
    "Unplaceable",
    "domain_members",
    "domain_of",
    "pick_gpus",
    "place_gang",
    "queue_order",
    "tier_level",
    "tier_names",
]
