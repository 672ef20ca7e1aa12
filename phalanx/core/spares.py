"""Spares kept in the domain (issue 34, item 2): a segmented gang with K spares per segment holds, inside each
segment's domain, K extra replicas' worth of GPUs, idle, in the same atomic reservation as the gang. When a node of
the gang is lost (or one of its GPUs fails), a spare of the same domain takes the dead node's replicas and the gang
restarts from its last committed checkpoint on the same domains, without going back through the queue.

Pure functions, no I/O: the scheduler (services/scheduler/spares.py), the simulator and the tests share them.

- `inflated`: the gang as placement sees it (segments of S + K replicas), so that placement, quotas and backfill
  count the spares with the gang;
- `split_spares`: such a placement back into the S active replicas of each segment (ranks contiguous per segment,
  numbered as a plain segmented gang's) and its K spares (replica indices -1, -2, ...: the ledger's rows for them
  are the gang's own, told apart by a negative replica);
- which spare takes each replica of a dead node is not decided here but by the recovery decision shared with the
  simulator (`phalanx.core.recovery.decide_recovery`, through `phalanx.core.gang_recovery.choose_swap`).

A spare is one replica's worth of GPUs (`gpus_per_replica`) in the segment's domain: a whole node when a replica
fills its node, the usual layout of a training gang (8 GPUs per replica on 8-GPU nodes). Placement puts the K spares
after the S active replicas of their segment (the fewest nodes, best fit), so with smaller replicas a spare may share
a node with active replicas; such a spare is not used for a swap off its own node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .model import Placement, ReplicaPlacement


def spare_replica(slot: int) -> int:
    """The ledger's replica index of spare slot `slot` (0, 1, ...): -1, -2, ... (active replicas are >= 0)."""
    return -1 - slot


def slot_of(replica: int) -> int:
    """The spare slot of a negative replica index (spare_replica's inverse)."""
    return -1 - replica


def inflated(replicas: int, segment: int, spares: int) -> tuple[int, int]:
    """(replicas, segment) as placement sees a gang with `spares` per segment: segments of segment + spares."""
    if spares <= 0 or segment <= 0 or replicas % segment:
        return replicas, segment
    return replicas // segment * (segment + spares), segment + spares


def inflated_min(min_replicas: int, segment: int, spares: int) -> int:
    """An elastic gang's minimum as placement sees it (`inflated`): MIN / S segments of S + K (0: not elastic)."""
    if min_replicas <= 0 or spares <= 0 or segment <= 0:
        return min_replicas
    return -(-min_replicas // segment) * (segment + spares)


@dataclass(frozen=True, slots=True)
class SpareSlot:
    """One spare of a gang: its slot (ledger replica spare_replica(slot)), its segment and that segment's domain,
    and the node it is booked on ("" while missing: used by a swap, or lost, and not booked again yet)."""

    slot: int
    segment: int
    domain: str
    node: str = ""
    gpus: tuple[int, ...] = ()

    @property
    def booked(self) -> bool:
        return bool(self.node)

    @property
    def replica(self) -> int:
        return spare_replica(self.slot)


def split_spares(placement: Placement, segment: int, spares: int) -> tuple[Placement, list[SpareSlot]]:
    """A placement of segments of `segment` + `spares` replicas -> the gang's own (segments of `segment` replicas,
    numbered 0 .. R-1 segment by segment) and its spares (the last `spares` of each placed segment, slots numbered
    segment by segment). The domains stay `placement.segments`."""
    if spares <= 0:
        return placement, []
    width = segment + spares
    ordered = sorted(placement.replicas, key=lambda r: r.replica)
    active: list[ReplicaPlacement] = []
    slots: list[SpareSlot] = []
    for i in range(0, len(ordered), width):
        seg = i // width
        domain = placement.segments[seg] if seg < len(placement.segments) else ""
        for j, rep in enumerate(ordered[i : i + width]):
            if j < segment:
                active.append(replace(rep, replica=seg * segment + j))
            else:
                slot = seg * spares + (j - segment)
                slots.append(SpareSlot(slot, seg, domain, rep.node, tuple(rep.gpus)))
    return replace(placement, replicas=tuple(active)), slots


def swapped_allocations(
    allocations: Sequence[tuple[int, str, tuple[int, ...]]], chosen: Mapping[int, SpareSlot]
) -> list[tuple[int, str, tuple[int, ...]]]:
    """The gang's (replica, node, GPUs) after a swap: the chosen spares' nodes for the dead node's replicas, every
    other replica where it was (the same rank order elsewhere)."""
    return [
        (rep, chosen[rep].node, chosen[rep].gpus) if rep in chosen else (rep, node, gpus)
        for rep, node, gpus in allocations
    ]


def describe_slots(slots: Sequence[SpareSlot]) -> str:
    """``node-6 (nvl-0), missing (nvl-1)`` for a person."""
    return ", ".join(f"{s.node or 'missing'} ({s.domain or 'segment ' + str(s.segment)})" for s in slots)
