"""Core value types: what a gang asks for, what a node offers, and a placement decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .mig import MEDIA_BIT, is_media

if TYPE_CHECKING:
    from .closeness import GpuCloseness

# What placement depends on besides the capacity (GangRequest.shape): replicas, GPUs per replica, GPU model, MIG
# profile, GPU share, required and preferred tier, CPUs, memory, segment, segment tier, minimum replicas (elastic).
Shape = tuple[int, int, str, str, int, str, str, int, int, int, str, int, bool]

FULL_MIG_MASK = 0xFF  # every memory slice of a GPU (mig.FULL_MASK): the GPU is held whole


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
    # Nodes that struck this gang (their host could not set up one of its ranks): placement avoids them while the
    # gang fits elsewhere, and uses them only when nothing else holds it.
    avoid: frozenset[str] = frozenset()
    # Soft preferences of a service's replica (never a reason to wait): `prefer`, the nodes of the domain it ran in
    # before (a restarted replica goes back there when it fits); `spread`, the nodes of the domains its sibling
    # replicas occupy (kept clear while the gang fits elsewhere, so one domain's failure takes fewer replicas down).
    prefer: frozenset[str] = frozenset()
    spread: frozenset[str] = frozenset()
    # The replicas of one service (`spread_group`, its name) keep apart in domains of `spread_tier`: within one
    # pass, a replica placed adds its domain's nodes to the `spread` of the group's next ones (backfill).
    spread_group: str = ""
    spread_tier: str = ""
    # Host resources of each replica on its node (core.resources): CPUs in thousandths and memory in bytes; 0 none.
    cpu_milli: int = 0
    memory: int = 0
    # Segments (multi-level gangs, placement.segments): the gang is replicas / segment segments of `segment`
    # replicas, each wholly inside one domain of `segment_tier` ("": the NVLink tier where the fabric has one, else
    # the leaf tier), a segment's ranks contiguous. 0: no segments.
    segment: int = 0
    segment_tier: str = ""
    # Elastic gangs (phalanx.core.elastic): the gang starts once this many replicas fit, taking as many as fit up to
    # `replicas` (its maximum) in one reservation. 0: not elastic (exactly `replicas`).
    min_replicas: int = 0
    # Spares kept in the domain (phalanx.core.spares): the last `spares` of each segment's `segment` replicas are
    # idle spares (negative replica indexes once reserved), not ranks. `replicas`, `segment` and `min_replicas` count
    # them (core.spares.inflated): placement sees the segments whole. 0: none.
    spares: int = 0
    # Its place in the queue (placement.queue_order): priority (higher first), submission time, id. Computed once:
    # a pass sorts thousands of pending gangs, and the scheduler keeps their requests from one cycle to the next.
    order: tuple[int, float, str] = field(init=False, repr=False, compare=False)
    # What placement depends on besides the capacity (backfill: gangs of one shape fit or not alike), computed once
    # for the same reason.
    shape: Shape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", (-self.priority, self.submitted_at, self.job_id))
        object.__setattr__(
            self,
            "shape",
            (
                self.replicas,
                self.gpus_per_replica,
                self.gpu_model,
                self.mig_profile,
                self.gpu_milli,
                self.required_tier,
                self.preferred_tier,
                self.cpu_milli,
                self.memory,
                self.segment,
                self.segment_tier,
                self.min_replicas,
                self.time_limit > 0,  # only a gang with a time limit may borrow a spare pool's nodes
            ),
        )

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def partial(self) -> bool:
        return bool(self.mig_profile) or self.gpu_milli > 0

    @property
    def elastic(self) -> bool:
        """It may run at fewer replicas than `replicas` (down to `min_replicas`)."""
        return 0 < self.min_replicas < self.replicas


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
    # Host resources it holds on its node (GangRequest.cpu_milli, .memory)
    cpu_milli: int = 0
    memory: int = 0

    @property
    def mig_mask(self) -> int:
        """What the instance takes of its GPU's MIG state mask: its memory slices, plus mig.MEDIA_BIT for a `+me`
        profile (one set of media engines per GPU)."""
        if not self.mig_profile:
            return 0
        return ((1 << self.mig_size) - 1) << self.mig_start | (MEDIA_BIT if is_media(self.mig_profile) else 0)


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
    # A segmented gang (GangRequest.segment): the domain of its segment tier each segment lies in, segment i holding
    # replicas i*S .. i*S+S-1. Empty for a plain gang.
    segments: tuple[str, ...] = ()

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

    MIG mode: `mig_gpus` are the GPUs in MIG mode (the agent's GpuInfo.mig_mode ENABLED). They serve only MIG
    instances: never in `free`, always in `mig` (mask 0 when empty). The other GPUs serve whole-GPU jobs and shares,
    never MIG. `foreign`: per GPU, the memory slices of MIG instances Phalanx did not make (managed=false); they stay
    used in `mig` for good. A foreign instance on a GPU not in MIG mode holds the whole GPU.
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
    mig_gpus: frozenset[int] = frozenset()
    foreign: dict[int, int] = field(default_factory=dict)
    # Host resources (core.resources): CPUs in thousandths and memory in bytes its agent reported (0: not reported,
    # and then no replica asking for them fits), and what replicas hold of them now.
    cpu_milli: int = 0
    memory: int = 0
    cpu_used: int = 0
    memory_used: int = 0

    def __post_init__(self) -> None:
        # Idempotent, so copies (dataclasses.replace) keep what they were given: a MIG-mode GPU is never free and
        # always carries at least its foreign slices; a GPU outside MIG mode with a foreign instance is held whole.
        if self.mig_gpus or self.foreign:
            if not isinstance(self.mig_gpus, frozenset):
                self.mig_gpus = frozenset(self.mig_gpus)
            for gpu in self.mig_gpus:
                self.free.discard(gpu)
                self.mig[gpu] = self.mig.get(gpu, 0) | self.foreign.get(gpu, 0)
            for gpu in self.foreign:
                if gpu not in self.mig_gpus:
                    self.free.discard(gpu)
                    self.mig[gpu] = FULL_MIG_MASK

    def base_mig(self, gpu: int) -> int | None:
        """The mask a GPU returns to when Phalanx's own instances on it are gone: its foreign slices on a GPU in MIG
        mode, the whole GPU when a foreign instance sits on one outside MIG mode; None: it goes back to `free`."""
        if gpu in self.mig_gpus:
            return self.foreign.get(gpu, 0)
        if gpu in self.foreign:
            return FULL_MIG_MASK
        return None

    def slots(self, gpus_per_replica: int) -> int:
        return len(self.free) // gpus_per_replica if self.schedulable and gpus_per_replica > 0 else 0
