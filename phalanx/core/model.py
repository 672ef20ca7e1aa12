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
    # Only nodes whose GPU model contains this text (case-insensitive). Empty: any.
    gpu_model: str = ""
    # Partial GPUs (then gpus_per_replica is 1): each replica is one MIG instance of `mig_profile`, or a share of
    # `gpu_milli` thousandths of one GPU. See core.shares.
    mig_profile: str = ""
    gpu_milli: int = 0
    # Declared seconds of runtime (0: none): backfill lets the gang start ahead of a blocked head only if it ends
    # before the head's reserved start, or stays off the head's region.
    time_limit: float = 0.0

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def partial(self) -> bool:
        return bool(self.mig_profile) or self.gpu_milli > 0


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """A replica's GPUs. For a partial GPU, `gpus` is its one GPU and either `mig_profile` (an instance of
    `mig_size` memory slices from `mig_start`) or `gpu_milli` (a share in thousandths) says which part."""

    replica: int
    node: str
    gpus: tuple[int, ...]
    mig_profile: str = ""
    mig_start: int = -1
    mig_size: int = 0
    gpu_milli: int = 0

    @property
    def mig_mask(self) -> int:
        return ((1 << self.mig_size) - 1) << self.mig_start if self.mig_profile else 0


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

    Partial GPUs: `mig` maps a GPU to the mask of its memory slices used by MIG instances, `milli` a GPU to the
    thousandths of it that fractional shares use. Such a GPU is not in `free` (no whole-GPU job may take it) until
    its last instance or share is released.
    """

    name: str
    total: int
    free: set[int] = field(default_factory=set)
    schedulable: bool = True
    path: tuple[str, ...] = ()
    closeness: GpuCloseness | None = None
    gpu_model: str = ""
    memory_mib: int = 0
    mig: dict[int, int] = field(default_factory=dict)
    milli: dict[int, int] = field(default_factory=dict)

    def slots(self, gpus_per_replica: int) -> int:
        return len(self.free) // gpus_per_replica if self.schedulable and gpus_per_replica > 0 else 0
