"""Baselines the placement tests compare gang scheduling with; the scheduler never uses them.

- `place_replicas_one_by_one`: per-replica mode, no gang semantics (a stock Kubernetes scheduler): partial gangs,
  and two gangs that each hold part of the cluster wait forever.
- `schedule_in_order`: strict queue order, each gang whole or the queue stops there (no backfill, no preemption).
"""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.core.capacity import ClusterCapacity
from phalanx.core.model import GangRequest, Placement, ReplicaPlacement
from phalanx.core.placement import Unplaceable, pick_gpus, place_gang, queue_order


def place_replicas_one_by_one(
    capacity: ClusterCapacity,
    request: GangRequest,
    held: Sequence[ReplicaPlacement] = (),
    limit: int | None = None,
) -> tuple[ReplicaPlacement, ...]:
    """Per-replica mode, no gang semantics: the baseline of a stock Kubernetes scheduler.

    Places the replicas `request` still lacks (beyond those in `held`) one at a time, each on the best-fit node
    (the tightest node with room), reserving it in `capacity` at once; stops when no node has room, or after
    `limit` new replicas. Returns `held` plus the replicas placed now: a partial gang keeps what it got, which is
    how two gangs can each hold part of the cluster and both wait forever. The scheduler never uses it.
    """
    placed = list(held)
    g = request.gpus_per_replica
    new = 0
    while len(placed) < request.replicas and (limit is None or new < limit) and g >= 1:
        node = capacity.tightest_node(g)
        if node is None:
            break
        gpus = pick_gpus(node.free, g)
        capacity.take(node.name, gpus)
        placed.append(ReplicaPlacement(len(placed), node.name, gpus))
        new += 1
    return tuple(placed)


def schedule_in_order(
    capacity: ClusterCapacity, pending: Sequence[GangRequest], fabric_tiers: Sequence[str] = ()
) -> tuple[list[Placement], Unplaceable | None]:
    """Serve `pending` in priority, then submission order: each gang all at once, or the queue stops there.

    Strict order means a large gang at the head is never starved by smaller ones behind it; it waits holding
    nothing. Reserves each placement in `capacity` as it goes. Returns the placements and, when the queue
    stopped at a gang that does not fit now, why.
    """
    placements: list[Placement] = []
    for request in queue_order(pending):
        result = place_gang(capacity, request, fabric_tiers)
        if isinstance(result, Unplaceable):
            return placements, result
        capacity.reserve(result)
        placements.append(result)
    return placements, None
