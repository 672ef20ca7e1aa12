"""Spares kept in the domain, as the SDK shows them on a Job (issue 34): each spare slot and the swaps made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.api.v1 import common_pb2


@dataclass(frozen=True, eq=True)
class Spare:
    """One spare slot of a gang with spares per segment: the segment it serves, that segment's domain, and the node
    it is booked on ("" while missing: used by a swap, or lost, and not booked again yet)."""

    segment: int
    domain: str
    node: str = ""
    booked: bool = False

    @classmethod
    def from_proto(cls, msg: common_pb2.JobSpare) -> Spare:
        return cls(int(msg.segment), msg.domain, msg.node, bool(msg.booked))

    def to_dict(self) -> dict[str, Any]:
        return {"segment": self.segment, "domain": self.domain, "node": self.node, "booked": self.booked}


def spare_fields(msg: common_pb2.Job) -> dict[str, Any]:
    """Job.from_proto's spares, swaps, last_swap_at and last_swap."""
    return dict(
        spares=tuple(Spare.from_proto(s) for s in msg.spares),
        swaps=int(msg.swaps),
        last_swap_at=float(msg.last_swap_at),
        last_swap=msg.last_swap,
    )
