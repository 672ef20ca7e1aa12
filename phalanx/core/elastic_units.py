"""What an elastic gang grows and shrinks by (issue 34): a replica, or, for a multi-level gang, a whole segment with
its spares kept in the domain. Pure: no I/O.

A segmented elastic gang (`--replicas MIN:MAX --segment S`, MIN and MAX multiples of S) runs with between MIN / S and
MAX / S whole segments, each inside one domain of its tier, and each with its K spares (`--spares-per-segment K`)
there. The decision core sees it as placement does (`GangRequest`, counted with the spares: core.spares.inflated):
`replicas` = MAX / S x (S + K), `segment` = S + K, `min_replicas` = MIN / S x (S + K). So every size the core
works out (what fits, what a grow targets, what a preemption leaves) is a whole number of those units, and a running
attempt's size is its segments times the unit, whether or not each of its spares is booked at the moment (a spare
used by a swap, or lost, is missing until it is booked again).

In a placement, active replicas have indexes >= 0, numbered segment by segment (segment i holds i*S .. i*S+S-1), and
spares negative ones (-1 - slot, slot i*K .. i*K+K-1 for segment i: core.spares.split_spares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .model import GangRequest, ReplicaPlacement


def unit(request: GangRequest) -> int:
    """Replicas (as the core counts them) an elastic gang grows or shrinks by: 1, or a segment with its spares."""
    return request.segment if request.segment > 0 else 1


def running_size(request: GangRequest, replicas: Sequence[ReplicaPlacement]) -> int:
    """The size an attempt runs at, in the request's units (its spares counted, booked or not)."""
    active = sum(1 for r in replicas if r.replica >= 0)
    if request.segment <= 0:
        return active
    width = request.segment - request.spares  # the ranks of one segment
    return active // max(1, width) * request.segment


def round_up(request: GangRequest, size: int) -> int:
    """`size` rounded up to whole units (at most the maximum)."""
    u = unit(request)
    return min(request.replicas, math.ceil(size / u) * u)


def segment_of(request: GangRequest, replica: int) -> int:
    """The segment a replica index belongs to (a spare's by its slot); 0 for a gang without segments."""
    if request.segment <= 0:
        return 0
    if replica >= 0:
        return replica // max(1, request.segment - request.spares)
    return (-1 - replica) // max(1, request.spares)


def split_at_minimum(
    request: GangRequest, replicas: Sequence[ReplicaPlacement]
) -> tuple[tuple[ReplicaPlacement, ...], tuple[ReplicaPlacement, ...]]:
    """An attempt's replicas -> (what it keeps when shrunk to its minimum, the rest). A segmented gang keeps its first
    MIN / S segments whole, their spares with them; any other keeps its first `min_replicas` replicas."""
    if request.segment <= 0:
        return tuple(replicas[: request.min_replicas]), tuple(replicas[request.min_replicas :])
    keep_segments = request.min_replicas // request.segment
    keep = tuple(r for r in replicas if segment_of(request, r.replica) < keep_segments)
    rest = tuple(r for r in replicas if segment_of(request, r.replica) >= keep_segments)
    return keep, rest


def shown(request: GangRequest, size: int) -> int:
    """A size in the request's units as its user counts it: replicas, or segments for a segmented gang (whose core
    units count the spares)."""
    return size // request.segment if request.segment > 0 else size


def noun(request: GangRequest) -> str:
    """What `shown` counts."""
    return "segments" if request.segment > 0 else "replicas"


def describe_minimum(request: GangRequest) -> str:
    """An elastic gang's minimum as its user gave it: '2 replicas', or '1 segment' (spares not counted)."""
    n = shown(request, request.min_replicas)
    return f"{n} {noun(request)}" if n != 1 or request.segment <= 0 else "1 segment"
