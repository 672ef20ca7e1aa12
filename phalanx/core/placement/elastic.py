"""Placement of an elastic gang (GangRequest.min_replicas): the most replicas that fit now, from `replicas` (its
maximum) down to `min_replicas`, as one all-or-nothing placement of the size chosen.

Fitting is monotone in the size (dropping a replica from a placement leaves a placement of the smaller gang, under
the same tier constraints), so the largest size that fits is found by trying the maximum, then the minimum, then a
binary search between them: at most 2 + log2(MAX - MIN) placements, and one in the common case (it fits whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..model import GangRequest, Placement
from .gang import Unplaceable

Place = Callable[[GangRequest], Placement | Unplaceable]


def place_elastic(request: GangRequest, place: Place) -> Placement | Unplaceable:
    """The largest placement of `request` between its minimum and maximum sizes; Unplaceable (saying the minimum
    does not fit) when not even `min_replicas` fit. `place` places a fixed-size gang."""
    low, high = request.min_replicas, request.replicas

    def at(size: int) -> Placement | Unplaceable:
        return place(replace(request, replicas=size, min_replicas=0))

    best = at(high)
    if isinstance(best, Placement):
        return best
    least = at(low)
    if isinstance(least, Unplaceable):
        return Unplaceable(
            request.job_id,
            f"not even its minimum of {low} of {high} replicas (elastic) fits: {least.reason}",
        )
    found, low = least, low + 1  # invariant: `found` fits at low - 1; nothing fits at high
    while low < high:
        mid = (low + high) // 2
        got = at(mid)
        if isinstance(got, Placement):
            found, low = got, mid + 1
        else:
            high = mid
    return replace(
        found,
        reason=f"{found.reason}; elastic: {len(found.replicas)} of at most {request.replicas} replicas fit now",
    )
