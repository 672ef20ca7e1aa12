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


@dataclass(frozen=True, eq=True)
class PoolDomain:
    """One domain of a spare pool: the nodes booked there, those lent (node -> the borrowing jobs), how many
    missing (no idle node to book yet)."""

    domain: str
    booked: tuple[str, ...] = ()
    lent: dict[str, tuple[str, ...]] | None = None
    missing: int = 0

    def to_dict(self) -> dict[str, Any]:
        lent = {n: list(j) for n, j in (self.lent or {}).items()}
        return {"domain": self.domain, "booked": list(self.booked), "lent": lent, "missing": self.missing}


@dataclass(frozen=True, eq=True)
class SparePool:
    """An operator's spare pool (`phalanx pool create`): `per_domain` whole nodes kept idle in each domain of `tier`
    for any gang there that loses a node, lent meanwhile to backfill jobs with time limits."""

    name: str
    tier: str
    per_domain: int
    created_at: float = 0.0
    domains: tuple[PoolDomain, ...] = ()

    @classmethod
    def from_proto(cls, msg: Any) -> SparePool:
        domains = tuple(
            PoolDomain(d.domain, tuple(d.booked), {x.node: tuple(x.jobs) for x in d.lent}, int(d.missing))
            for d in msg.domains
        )
        return cls(msg.name, msg.tier, int(msg.per_domain), float(msg.created_at), domains)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tier": self.tier,
            "per_domain": self.per_domain,
            "created_at": self.created_at,
            "domains": [d.to_dict() for d in self.domains],
        }
