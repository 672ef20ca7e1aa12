"""Core value types: what a gang asks for, what a node offers, and a placement decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .closeness import GpuCloseness


@dataclass(frozen=True, slots=True)
class GangRequest:
    """R replicas x G GPUs that must start together; each replica lives on one node."""

    job_id: str
    replicas: int
    gpus_per_replica: int
    priority: int = 0
    submitted_at: float = 0.0
    # Kueue TAS style constraints, by tier name ("node", a fabric tier such as "leaf", or "cluster"): the gang must
    # fit under one domain of `required_tier` or wait; `preferred_tier` is best effort. Empty: no constraint.
    required_tier: str = ""
    preferred_tier: str = ""

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    replica: int
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every replica of a gang goes, in ring order, and why.

    `tier` is the highest tier the gang crosses ("node" when it fits in one node), `domains` how many domains of
    the tier below it spans, `score` a lower-is-better summary of both.
    """

    job_id: str
    replicas: tuple[ReplicaPlacement, ...]
    tier: str
    domains: int
    score: float
    reason: str

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.node for r in self.replicas))


@dataclass(slots=True)
class NodeCapacity:
    """Free GPUs of one node. `path` is its switches from the leaf up (see core.fabric).

    `closeness`: how close each pair of its GPUs is (from its `nvidia-smi topo -m` matrix); None when unknown,
    and then GPUs are chosen by index alone (see placement.pick_gpus).
    """

    name: str
    total: int
    free: set[int] = field(default_factory=set)
    schedulable: bool = True
    path: tuple[str, ...] = ()
    closeness: GpuCloseness | None = None

    def slots(self, gpus_per_replica: int) -> int:
        return len(self.free) // gpus_per_replica if self.schedulable and gpus_per_replica > 0 else 0
