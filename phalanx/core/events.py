"""The events a history of scheduling is made of, as the invariant checks (phalanx.core.invariants) read them:
the cluster at the start, submissions, starts and ends of attempts, releases, preemption asks and claims, failures,
MIG mode changes, reservations and the quiet point. Written by the world model (phalanx.testing.world) and read
back from the ledger (phalanx.testing.history); plain frozen data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Hold:
    """What a replica holds of one GPU: all of it, a MIG instance (`mig_mask`: its memory slices) or a share
    (`milli` thousandths)."""

    node: str
    gpu: int
    mig_mask: int = 0
    milli: int = 0

    @property
    def whole(self) -> bool:
        return not (self.mig_mask or self.milli)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The nodes (name -> GPUs) and the GPUs in MIG mode, at the start; the fabric's tier names (lowest first) and,
    per tier, each node's domain (for the segments of multi-level gangs; empty: not checked)."""

    t: float
    nodes: Mapping[str, int]
    mig: frozenset[tuple[str, int]] = frozenset()
    tiers: tuple[str, ...] = ()
    domains: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A job entered the queue. `demand`: (GPUs, MIG compute slices) it holds when running (quota.demand);
    `fits_empty`: whether it fits the empty cluster (liveness is owed only to those)."""

    t: float
    job: str
    priority: int
    queue: str = "default"
    replicas: int = 1
    gpus_per_replica: int = 1
    demand: tuple[float, float] = (0.0, 0.0)
    fits_empty: bool = True
    # False: it may never preempt (a service's surge replica during a rolling update; invariant g)
    preempts: bool = True
    # A multi-level gang: replicas per segment (0: none) and the tier each segment lies in ("": the default)
    segment: int = 0
    segment_tier: str = ""
    spares: int = 0  # spares kept in the domain: per segment (0: none)
    # An elastic gang's minimum (`replicas` its maximum; 0: not elastic; invariant h)
    min_replicas: int = 0


@dataclass(frozen=True, slots=True)
class Started:
    """An attempt of `job` was reserved with `holds` (`expected`: how many its gang needs: replicas x GPUs per
    replica, or one per replica for partial GPUs), admitted under quota `flavor`."""

    t: float
    job: str
    attempt: int
    holds: tuple[Hold, ...]
    expected: int
    flavor: str = ""
    # The node of each replica, in rank order (empty: not recorded; segments are then not checked)
    replica_nodes: tuple[str, ...] = ()
    # Spares kept in the domain: (segment, node) of each booked spare and their GPUs (among `holds`, no rank's);
    # `swap_of`: the attempt this one replaces by a spare swap (0: none; invariant i)
    spares: tuple[tuple[int, str], ...] = ()
    spare_holds: tuple[Hold, ...] = ()
    swap_of: int = 0


@dataclass(frozen=True, slots=True)
class Ended:
    """An attempt ended (`outcome`: PREEMPTED, SUCCEEDED, NODE_LOST, ...). Its GPUs on `held` nodes stay held until
    `Released` (its processes there were still exiting); elsewhere they are free at once."""

    t: float
    job: str
    attempt: int
    outcome: str
    held: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Released:
    """The node confirmed that an ended attempt's processes there are gone: its GPUs there are free."""

    t: float
    job: str
    attempt: int
    node: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The job reached a final state (SUCCEEDED, FAILED, CANCELLED)."""

    t: float
    job: str
    state: str


@dataclass(frozen=True, slots=True)
class Asked:
    """A running attempt was asked to checkpoint and stop for preemptor `by` (`reclaim`: to take back quota its
    queue borrowed)."""

    t: float
    victim: str
    attempt: int
    by: str
    reclaim: bool = False


@dataclass(frozen=True, slots=True)
class CalledOff:
    """The preemption of a running attempt was called off (its preemptor found room elsewhere): it runs on, and the
    deadline that backfill counted as its end no longer holds."""

    t: float
    victim: str
    attempt: int


@dataclass(frozen=True, slots=True)
class ClaimMade:
    """`job` claims `holds` (whole GPUs, MIG instances, shares), for `victims` (a new claim or a replacement)."""

    t: float
    job: str
    holds: tuple[Hold, ...]
    victims: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimEnded:
    t: float
    job: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class NodeDown:
    t: float
    node: str


@dataclass(frozen=True, slots=True)
class NodeUp:
    t: float
    node: str


@dataclass(frozen=True, slots=True)
class GpusLost:
    """GPUs turned unusable (a fatal error): capacity lost."""

    t: float
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GpusBack:
    """GPUs that had failed are healthy again (repaired): capacity back."""

    t: float
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MigMode:
    """A GPU's MIG mode changed (`on`: into MIG mode)."""

    t: float
    node: str
    gpu: int
    on: bool


@dataclass(frozen=True, slots=True)
class Reserved:
    """A decision's blocked head `job` and its backfill reservation, starting at `start` (inf: only once a gang
    without a time limit ends); one per decision, `job` "" when it had no head with a reservation. A reservation is
    judged while the same job stays the head, decision after decision."""

    t: float
    job: str
    start: float


@dataclass(frozen=True, slots=True)
class Quiet:
    """From here on: no arrivals, no failures. Liveness (d) is judged at the end of the history, for the jobs
    `owed` it (None: those submitted as fitting the empty cluster; a model that changed MIG modes names the jobs
    that fit the cluster as it is now)."""

    t: float
    owed: frozenset[str] | None = None


Event = (
    Cluster
    | Submitted
    | Started
    | Ended
    | Released
    | Finished
    | Asked
    | CalledOff
    | ClaimMade
    | ClaimEnded
    | NodeDown
    | NodeUp
    | GpusLost
    | GpusBack
    | MigMode
    | Reserved
    | Quiet
)
