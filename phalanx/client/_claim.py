"""A pending preemptor's claim, as the SDK shows it on a Job (get_job only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.api.v1 import common_pb2


@dataclass(frozen=True, eq=True)
class Claim:
    """A pending preemptor's claim on the capacity its victims free (get_job only): where it goes (`nodes`, `gpus`),
    the gangs asked to stop for it (`victims`) and since when, and what it still waits for (victims still
    `stopping`, claimed GPUs still `releasing_gpus`, and `waits_for` in a sentence)."""

    nodes: tuple[str, ...]
    gpus: int
    victims: tuple[str, ...]
    since: float
    stopping: tuple[str, ...] = ()
    releasing_gpus: int = 0
    waits_for: str = ""

    @classmethod
    def from_proto(cls, msg: common_pb2.Claim) -> Claim:
        return cls(
            tuple(msg.nodes),
            int(msg.gpus),
            tuple(msg.victims),
            float(msg.since),
            tuple(msg.stopping),
            int(msg.releasing_gpus),
            msg.waits_for,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "gpus": self.gpus,
            "victims": list(self.victims),
            "since": self.since,
            "stopping": list(self.stopping),
            "releasing_gpus": self.releasing_gpus,
            "waits_for": self.waits_for,
        }
