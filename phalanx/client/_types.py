"""Typed, immutable (frozen) views of the scheduler's protobuf messages, and their JSON shape (the CLI's contract)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.resources import parse_size

from ._claim import Claim  # importable from here too
from ._graph import ArrayProgress, Dependency
from ._spares import Spare, spare_fields

__all__ = [
    "JobState",
    "NodeState",
    "Allocation",
    "Claim",
    "Goodput",
    "Job",
    "ArrayProgress",
    "Dependency",
    "JobGoodput",
    "GroupGoodput",
    "GoodputReport",
    "CheckpointResult",
    "Node",
    "TERMINAL_STATES",
    "job_state_to_proto",
]


class JobState(str, enum.Enum):
    """Lifecycle of a job. A job holds GPUs only while RUNNING."""

    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    # Still running and holding its GPUs: asked to checkpoint before it is stopped for a higher-priority gang.
    PREEMPTING = "PREEMPTING"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        """Whether the job will never change state again."""
        return self in TERMINAL_STATES

    @classmethod
    def parse(cls, value: str | JobState) -> JobState:
        """Parse ``"running"``, ``"RUNNING"`` or ``"JOB_STATE_RUNNING"``.

        Args:
            value: A state name, any case, with or without the ``JOB_STATE_`` prefix.

        Returns:
            The state.

        Raises:
            ValueError: If the name is not a job state.
        """
        if isinstance(value, JobState):
            return value
        name = str(value).strip().upper()
        name = name.removeprefix("JOB_STATE_")
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(s.value for s in cls if s is not cls.UNSPECIFIED)
            raise ValueError(f"unknown job state {value!r} (expected one of {valid})") from None


class NodeState(str, enum.Enum):
    """Whether a node takes work."""

    UNSPECIFIED = "UNSPECIFIED"
    READY = "READY"
    DRAINED = "DRAINED"
    LOST = "LOST"

    def __str__(self) -> str:
        return self.value


# SUCCEEDED, FAILED and CANCELLED are final. PREEMPTED and PREEMPTING are not: a preempted job goes back to PENDING.
TERMINAL_STATES: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


def _enum_from_proto(enum_cls: type[enum.Enum], descriptor: Any, prefix: str, number: int) -> Any:
    try:
        name = descriptor.Name(number)
    except ValueError:
        return enum_cls("UNSPECIFIED")
    return enum_cls(name.removeprefix(prefix))


def job_state_to_proto(state: str | JobState) -> common_pb2.JobState:
    """Map a job state (or its name) to the protobuf enum number.

    Args:
        state: A :class:`JobState` or a name accepted by :meth:`JobState.parse`.

    Returns:
        The ``phalanx.v1.JobState`` number.
    """
    return common_pb2.JobState.Value(  # type: ignore[no-any-return]  # protobuf ships no types: Value() is Any
        "JOB_STATE_" + JobState.parse(state).value
    )


@dataclass(frozen=True, eq=True)
class MigSlice:
    """One MIG instance: ``size`` memory slices of GPU ``gpu`` from slice ``start`` (NVIDIA's placement units)."""

    gpu: int
    profile: str
    start: int
    size: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"gpu": int, "profile": str, "start": int, "size": int}``."""
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start, "size": self.size}


@dataclass(frozen=True, eq=True)
class Allocation:
    """GPUs of one replica on one node; for a partial GPU, its MIG instance (``slices``) or share (``gpu_milli``)."""

    replica: int
    node: str
    gpus: list[int] = field(default_factory=list)
    slices: list[MigSlice] = field(default_factory=list)
    gpu_milli: int = 0
    cpus: float = 0.0  # host CPUs and memory (bytes) reserved for it on its node
    memory_bytes: int = 0

    @classmethod
    def from_proto(cls, msg: common_pb2.Allocation) -> Allocation:
        """Build from a ``phalanx.v1.Allocation`` message."""
        return cls(
            replica=int(msg.replica),
            node=msg.node,
            gpus=[int(g) for g in msg.gpus],
            slices=[MigSlice(int(s.gpu), s.profile, int(s.start), int(s.size)) for s in msg.slices],
            gpu_milli=int(msg.gpu_milli),
            cpus=float(msg.cpus),
            memory_bytes=int(msg.memory_bytes),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"replica": int, "node": str, "gpus": [int, ...]}``, plus ``slices`` (a list of
        ``{"gpu", "profile", "start", "size"}``) for a MIG instance, ``gpu_milli`` for a GPU share, and ``cpus``
        and ``memory_bytes`` when it reserved host resources."""
        out: dict[str, Any] = {"replica": self.replica, "node": self.node, "gpus": list(self.gpus)}
        if self.slices:
            out["slices"] = [s.to_dict() for s in self.slices]
        if self.gpu_milli:
            out["gpu_milli"] = self.gpu_milli
        if self.cpus:
            out["cpus"] = self.cpus
        if self.memory_bytes:
            out["memory_bytes"] = self.memory_bytes
        return out


@dataclass(frozen=True, eq=True)
class Goodput:
    """Where GPU time went, in GPU-seconds: ``allocated = productive + rollback + restart``; ``waiting`` is the
    job's GPUs x the time it was queued; ``ratio`` is productive / allocated (1.0 when nothing was allocated)."""

    allocated: float = 0.0
    productive: float = 0.0
    rollback: float = 0.0
    restart: float = 0.0
    waiting: float = 0.0
    ratio: float = 0.0

    @classmethod
    def from_proto(cls, msg: common_pb2.Goodput) -> Goodput:
        """Build from a ``phalanx.v1.Goodput`` message."""
        return cls(
            allocated=float(msg.allocated),
            productive=float(msg.productive),
            rollback=float(msg.rollback),
            restart=float(msg.restart),
            waiting=float(msg.waiting),
            ratio=float(msg.ratio),
        )

    def to_dict(self) -> dict[str, float]:
        """The JSON shape: ``{"allocated", "productive", "rollback", "restart", "waiting", "ratio"}`` (floats)."""
        return {
            "allocated": self.allocated,
            "productive": self.productive,
            "rollback": self.rollback,
            "restart": self.restart,
            "waiting": self.waiting,
            "ratio": self.ratio,
        }


@dataclass(frozen=True, eq=True)
class Job:
    """A job as the scheduler reports it. Times are unix seconds; 0 means "not yet"."""

    id: str
    name: str
    state: JobState
    replicas: int
    gpus_per_replica: int
    priority: int = 0
    procs_per_replica: int = 0
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # The GPUs it holds: only a RUNNING (or PREEMPTING) job has any, those of its current attempt; a pending one
    # (also when requeued after a failure) and a finished one hold none, so this is [] for them.
    allocations: list[Allocation] = field(default_factory=list)
    attempt: int = 0
    message: str = ""
    submitted_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    exit_code: int = 0
    placement: dict[str, Any] = field(default_factory=dict)
    # Topology constraints by tier name ("node", a fabric tier such as "leaf", or "cluster"); "" means none.
    required_tier: str = ""
    preferred_tier: str = ""
    # GPU model filter and partial GPUs (see phalanx.v1.JobSpec); "" / 0 means none.
    gpu_model: str = ""
    mig_profile: str = ""
    gpu_milli: int = 0
    max_restarts: int = 0  # a rank exiting non-zero requeues the gang this many times (0: it fails the job)
    time_limit: float = 0.0  # declared seconds per attempt (0: none)
    keep_checkpoints: int = 0  # newest committed checkpoints the coordinator keeps (0: its --keep-checkpoints)
    # Host resources each replica reserves on its node and is limited to: CPUs, and memory in bytes (0: none)
    cpus_per_replica: float = 0.0
    memory_per_replica: int = 0
    # A multi-level gang: replicas per segment (0: none), the tier each lies in ("": NVLink, else leaf), and the
    # domain each segment was placed in (segment i holds replicas i*segment .. i*segment+segment-1).
    segment: int = 0
    segment_tier: str = ""
    segment_domains: tuple[str, ...] = ()
    # Spares kept in the domain: per segment (0: none), each spare slot (booked or missing), swaps made, the last
    spares_per_segment: int = 0
    spares: tuple[Spare, ...] = ()
    swaps: int = 0
    last_swap_at: float = 0.0
    last_swap: str = ""
    tenant: str = ""  # who submitted it ("" when authentication is off)
    queue: str = "default"
    flavor: str = ""  # the quota flavor its attempt was admitted under ("" without quotas)
    # Recovery and preemption: attempts torn down by a failure, times preempted, the end of a requeued job's retry
    # backoff (0: none); while PREEMPTING, the job that needs its GPUs and when it is stopped at the latest.
    failures: int = 0
    preemptions: int = 0
    not_before: float = 0.0
    preempted_by: str = ""
    preempt_deadline: float = 0.0
    # Nodes whose host could not set up one of its ranks (a retryable launch failure): it avoids them while it fits
    # elsewhere.
    struck_nodes: tuple[str, ...] = ()
    # Serving: the service this job is a replica of ("" for a plain job), its replica index and revision there, and
    # whether its readiness probe passes now (a replica without a probe is ready once every rank runs), since when.
    service: str = ""
    service_replica: int = 0
    service_revision: int = 0
    ready: bool = False
    ready_at: float = field(default=0.0, compare=False)
    # An elastic gang (``phalanx submit --replicas MIN:MAX``): its minimum (``replicas`` is its maximum; 0: not
    # elastic), and the replicas its current attempt runs with (0: not running, or not elastic).
    min_replicas: int = 0
    current_replicas: int = 0
    # What the current attempt restored from (get_job only; "" elsewhere and before any rank reported).
    restore: str = field(default="", compare=False)
    # A pending preemptor's standing claim (get_job only; None elsewhere, and for any other job).
    claim: Claim | None = field(default=None, compare=False)
    # GPU-time accounting, filled by get_job only (None elsewhere). It grows with time while the job runs, so it
    # takes no part in equality (watch compares jobs to drop repeats).
    goodput: Goodput | None = field(default=None, compare=False)
    # watch only: when this change happened (unix seconds, the scheduler's commit; 0 elsewhere). Not in to_dict.
    changed_at: float = field(default=0.0, compare=False)
    # Job graphs: the jobs it waits for (as submitted) and those not met yet; an array's spec ("" otherwise) and,
    # on the array's own job, its tasks' progress; on a task, its array's job id and its index (-1 otherwise).
    after: tuple[Dependency, ...] = ()
    waiting_for: tuple[Dependency, ...] = ()
    array_spec: str = ""
    array: ArrayProgress | None = None
    array_parent: str = ""
    array_task: int = -1

    @property
    def terminal(self) -> bool:
        """Whether the job has finished for good (SUCCEEDED, FAILED or CANCELLED)."""
        return self.state in TERMINAL_STATES

    @property
    def total_gpus(self) -> int:
        """GPUs the whole gang needs: replicas x gpus_per_replica."""
        return self.replicas * self.gpus_per_replica

    @property
    def nodes(self) -> tuple[str, ...]:
        """Distinct nodes of its allocations (the GPUs it holds while it runs), in replica order; () otherwise."""
        seen: dict[str, None] = {}
        for alloc in sorted(self.allocations, key=lambda a: a.replica):
            seen.setdefault(alloc.node, None)
        return tuple(seen)

    @classmethod
    def from_proto(cls, msg: common_pb2.Job) -> Job:
        """Build from a ``phalanx.v1.Job`` message."""
        spec = msg.spec
        placement: dict[str, Any] = {}
        if msg.HasField("placement"):
            p = msg.placement
            placement = {"tier": p.tier, "domains": int(p.domains), "score": float(p.score), "reason": p.reason}
        return cls(
            id=msg.id,
            name=spec.name,
            state=_enum_from_proto(JobState, common_pb2.JobState, "JOB_STATE_", msg.state),
            replicas=int(spec.replicas),
            gpus_per_replica=int(spec.gpus_per_replica),
            priority=int(spec.priority),
            procs_per_replica=int(spec.procs_per_replica),
            command=list(spec.command),
            env=dict(spec.env),
            allocations=[Allocation.from_proto(a) for a in msg.allocations],
            attempt=int(msg.attempt),
            message=msg.message,
            submitted_at=float(msg.submitted_at),
            started_at=float(msg.started_at),
            finished_at=float(msg.finished_at),
            exit_code=int(msg.exit_code),
            placement=placement,
            required_tier=spec.required_tier,
            preferred_tier=spec.preferred_tier,
            gpu_model=spec.gpu_model,
            mig_profile=spec.mig_profile,
            gpu_milli=int(spec.gpu_milli),
            max_restarts=int(spec.max_restarts),
            time_limit=float(spec.time_limit_s),
            keep_checkpoints=int(spec.keep_checkpoints),
            cpus_per_replica=float(spec.cpus_per_replica),
            memory_per_replica=parse_size(spec.memory_per_replica) if spec.memory_per_replica else 0,
            segment=int(spec.segment),
            segment_tier=spec.segment_tier,
            segment_domains=tuple(msg.segment_domains),
            spares_per_segment=int(spec.spares_per_segment),
            **spare_fields(msg),
            tenant=msg.tenant,
            queue=spec.queue or "default",
            flavor=msg.flavor,
            failures=int(msg.failures),
            preemptions=int(msg.preemptions),
            not_before=float(msg.not_before),
            preempted_by=msg.preempted_by,
            preempt_deadline=float(msg.preempt_deadline),
            struck_nodes=tuple(msg.struck_nodes),
            service=msg.service,
            service_replica=int(msg.service_replica),
            service_revision=int(msg.service_revision),
            ready=bool(msg.ready),
            ready_at=float(msg.ready_at),
            min_replicas=int(spec.min_replicas),
            current_replicas=int(msg.current_replicas),
            restore=msg.restore,
            claim=Claim.from_proto(msg.claim) if msg.HasField("claim") else None,
            goodput=Goodput.from_proto(msg.goodput) if msg.HasField("goodput") else None,
            after=tuple(Dependency.from_proto(d) for d in spec.after),
            waiting_for=tuple(Dependency.from_proto(d) for d in msg.waiting_for),
            array_spec=spec.array,
            array=ArrayProgress.from_proto(msg.array) if msg.HasField("array") else None,
            array_parent=msg.array_parent,
            array_task=int(msg.array_task) if msg.array_parent else -1,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``phalanx ... --json`` (a stable contract)."""
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state.value,
            "replicas": self.replicas,
            "gpus_per_replica": self.gpus_per_replica,
            "priority": self.priority,
            "procs_per_replica": self.procs_per_replica,
            "required_tier": self.required_tier,
            "preferred_tier": self.preferred_tier,
            "gpu_model": self.gpu_model,
            "mig_profile": self.mig_profile,
            "gpu_milli": self.gpu_milli,
            "max_restarts": self.max_restarts,
            "time_limit": self.time_limit,
            "keep_checkpoints": self.keep_checkpoints,
            "cpus_per_replica": self.cpus_per_replica,
            "memory_per_replica": self.memory_per_replica,
            "segment": self.segment,
            "segment_tier": self.segment_tier,
            "segment_domains": list(self.segment_domains),
            "spares_per_segment": self.spares_per_segment,
            "spares": [s.to_dict() for s in self.spares],
            "swaps": self.swaps,
            "last_swap_at": self.last_swap_at,
            "last_swap": self.last_swap,
            "tenant": self.tenant,
            "queue": self.queue,
            "flavor": self.flavor,
            "command": list(self.command),
            "env": dict(self.env),
            "allocations": [a.to_dict() for a in self.allocations],
            "attempt": self.attempt,
            "message": self.message,
            "exit_code": self.exit_code,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "placement": dict(self.placement),
            "failures": self.failures,
            "preemptions": self.preemptions,
            "not_before": self.not_before,
            "preempted_by": self.preempted_by,
            "preempt_deadline": self.preempt_deadline,
            "struck_nodes": list(self.struck_nodes),
            "service": self.service,
            "service_replica": self.service_replica,
            "service_revision": self.service_revision,
            "ready": self.ready,
            "min_replicas": self.min_replicas,
            "current_replicas": self.current_replicas,
            "restore": self.restore,
            "claim": None if self.claim is None else self.claim.to_dict(),
            "goodput": None if self.goodput is None else self.goodput.to_dict(),
            "after": [d.to_dict() for d in self.after],
            "waiting_for": [d.to_dict() for d in self.waiting_for],
            "array_spec": self.array_spec,
            "array": None if self.array is None else self.array.to_dict(),
            "array_parent": self.array_parent,
            "array_task": self.array_task,
        }


@dataclass(frozen=True, eq=True)
class JobGoodput:
    """One job's line of :meth:`Client.goodput`."""

    job_id: str
    name: str
    state: JobState
    goodput: Goodput
    attempts: int = 0

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.JobGoodput) -> JobGoodput:
        """Build from a ``phalanx.v1.JobGoodput`` message."""
        return cls(
            job_id=msg.job_id,
            name=msg.name,
            state=_enum_from_proto(JobState, common_pb2.JobState, "JOB_STATE_", msg.state),
            goodput=Goodput.from_proto(msg.goodput),
            attempts=int(msg.attempts),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"job_id", "name", "state", "attempts", "goodput": {...}}``."""
        return {
            "job_id": self.job_id,
            "name": self.name,
            "state": self.state.value,
            "attempts": self.attempts,
            "goodput": self.goodput.to_dict(),
        }


@dataclass(frozen=True, eq=True)
class GroupGoodput:
    """One tenant's or one queue's part of :meth:`Client.goodput`'s cluster total, over ``job_count`` jobs."""

    name: str
    goodput: Goodput
    job_count: int = 0

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.GroupGoodput) -> GroupGoodput:
        """Build from a ``phalanx.v1.GroupGoodput`` message."""
        return cls(name=msg.name, goodput=Goodput.from_proto(msg.goodput), job_count=int(msg.job_count))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: ``{"name", "job_count", "goodput": {...}}``."""
        return {"name": self.name, "job_count": self.job_count, "goodput": self.goodput.to_dict()}


@dataclass(frozen=True, eq=True)
class GoodputReport:
    """The result of :meth:`Client.goodput`: the cluster total over ``job_count`` jobs, its parts by tenant and by
    queue, and a page of the newest jobs (``next_page_token``: pass it as ``page_token`` for the next page; "" on the
    last)."""

    cluster: Goodput
    jobs: list[JobGoodput] = field(default_factory=list)
    job_count: int = 0
    tenants: list[GroupGoodput] = field(default_factory=list)
    queues: list[GroupGoodput] = field(default_factory=list)
    next_page_token: str = ""

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.GetGoodputResponse) -> GoodputReport:
        """Build from a ``phalanx.v1.GetGoodputResponse`` message."""
        return cls(
            cluster=Goodput.from_proto(msg.cluster),
            jobs=[JobGoodput.from_proto(j) for j in msg.jobs],
            job_count=int(msg.job_count),
            tenants=[GroupGoodput.from_proto(t) for t in msg.tenants],
            queues=[GroupGoodput.from_proto(q) for q in msg.queues],
            next_page_token=msg.next_page_token,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``phalanx goodput --json``: ``{"cluster", "job_count", "jobs", "tenants",
        "queues", "next_page_token"}``."""
        return {
            "cluster": self.cluster.to_dict(),
            "job_count": self.job_count,
            "jobs": [j.to_dict() for j in self.jobs],
            "tenants": [t.to_dict() for t in self.tenants],
            "queues": [q.to_dict() for q in self.queues],
            "next_page_token": self.next_page_token,
        }


@dataclass(frozen=True, eq=True)
class CheckpointResult:
    """The result of :meth:`Client.checkpoint`: the job, and the outstanding request's reason and time (an
    earlier request that has not been served yet is kept, with its own reason)."""

    job: Job
    reason: str
    requested_at: float

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.CheckpointJobResponse) -> CheckpointResult:
        """Build from a ``phalanx.v1.CheckpointJobResponse`` message."""
        return cls(job=Job.from_proto(msg.job), reason=msg.reason, requested_at=float(msg.requested_at))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``phalanx checkpoint --json``: ``{"job_id", "reason", "requested_at", "job"}``."""
        return {
            "job_id": self.job.id,
            "reason": self.reason,
            "requested_at": self.requested_at,
            "job": self.job.to_dict(),
        }


@dataclass(frozen=True, eq=True)
class Node:
    """A GPU node as the scheduler sees it."""

    name: str
    gpus: int
    free_gpus: int
    state: NodeState
    profile: str = ""
    gpu_model: str = ""
    fabric_path: list[str] = field(default_factory=list)
    message: str = ""
    last_heartbeat: float = 0.0
    address: str = ""
    shared_gpus: int = 0  # GPUs split into MIG instances or fractional shares
    health: str = "HEALTHY"  # HEALTHY, DEGRADED or FATAL (UNSPECIFIED from a scheduler without health)
    health_reason: str = ""  # e.g. "GPU 3: XID 79: GPU has fallen off the bus"
    # GPUs that are not HEALTHY: index -> {"state": "FATAL", "reasons": [...]}; FATAL ones take no new work
    unhealthy_gpus: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Each GPU as registered: {"index", "uuid", "name", "memory_mib", "mig_mode" ("enabled": only MIG instances;
    # "disabled" or "unsupported": whole GPUs and shares, never MIG), "mig_instances": [{"profile", "start", "size",
    # "uuid", "managed", "gpu_instance_id", "compute_instance_id"}]}; managed false: made by someone else (occupied)
    # --mig-manage also adds per GPU "mig_mode_pending" (the mode a GPU reset will apply: "enabled", "disabled", ""
    # when none), "mig_switching" (a switch the scheduler asked is under way) and "mig_switch_error" (why the last
    # one failed, "" when it did not)
    gpu_details: list[dict[str, Any]] = field(default_factory=list)
    strikes: int = 0  # times a rank could not be set up on this host (retryable launch failures)
    mig_manage: bool = False  # its agent runs with --mig-manage: the scheduler may switch idle GPUs' MIG mode
    containment: str = ""  # how its agent contains ranks: "cgroup-v2", "cgroup-v1" or "process-group"
    releasing_gpus: int = 0  # GPUs of ended gangs held until their processes here are gone
    # Host CPUs and memory (bytes) its agent reported (0: not reported), and what no gang holds of them now
    cpus: float = 0.0
    memory_bytes: int = 0
    free_cpus: float = 0.0
    free_memory_bytes: int = 0

    @property
    def mig_gpus(self) -> list[int]:
        """The GPUs in MIG mode (they take only MIG instances)."""
        return [g["index"] for g in self.gpu_details if g.get("mig_mode") == "enabled"]

    @property
    def fatal_gpus(self) -> list[int]:
        return sorted(i for i, g in self.unhealthy_gpus.items() if g.get("state") == "FATAL")

    @classmethod
    def from_proto(cls, msg: common_pb2.Node) -> Node:
        """Build from a ``phalanx.v1.Node`` message."""
        return cls(
            name=msg.name,
            gpus=int(msg.gpus),
            free_gpus=int(msg.free_gpus),
            state=_enum_from_proto(NodeState, common_pb2.NodeState, "NODE_STATE_", msg.state),
            profile=msg.profile,
            gpu_model=msg.gpu_model,
            fabric_path=list(msg.fabric_path),
            message=msg.message,
            last_heartbeat=float(msg.last_heartbeat),
            address=msg.address,
            shared_gpus=int(msg.shared_gpus),
            health=common_pb2.HealthState.Name(msg.health.state).removeprefix("HEALTH_STATE_"),
            health_reason=msg.health.reason,
            unhealthy_gpus={
                int(g.index): {
                    "state": common_pb2.HealthState.Name(g.state).removeprefix("HEALTH_STATE_"),
                    "reasons": list(g.reasons),
                }
                for g in msg.health.gpus
            },
            gpu_details=[_node_gpu(g) for g in msg.gpu_details],
            strikes=int(msg.strikes),
            mig_manage=bool(msg.mig_manage),
            containment=msg.containment,
            releasing_gpus=int(msg.releasing_gpus),
            cpus=float(msg.cpus),
            memory_bytes=int(msg.memory_bytes),
            free_cpus=float(msg.free_cpus),
            free_memory_bytes=int(msg.free_memory_bytes),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``phalanx nodes --json`` (a stable contract)."""
        return {
            "name": self.name,
            "gpus": self.gpus,
            "free_gpus": self.free_gpus,
            "state": self.state.value,
            "profile": self.profile,
            "gpu_model": self.gpu_model,
            "fabric_path": list(self.fabric_path),
            "message": self.message,
            "last_heartbeat": self.last_heartbeat,
            "address": self.address,
            "shared_gpus": self.shared_gpus,
            "health": self.health,
            "health_reason": self.health_reason,
            "unhealthy_gpus": {str(i): dict(g) for i, g in sorted(self.unhealthy_gpus.items())},
            "gpu_details": [
                {**g, "mig_instances": [dict(i) for i in g.get("mig_instances", ())]} for g in self.gpu_details
            ],
            "strikes": self.strikes,
            "mig_manage": self.mig_manage,
            "containment": self.containment,
            "releasing_gpus": self.releasing_gpus,
            "cpus": self.cpus,
            "memory_bytes": self.memory_bytes,
            "free_cpus": self.free_cpus,
            "free_memory_bytes": self.free_memory_bytes,
        }


def _node_gpu(g: common_pb2.NodeGpu) -> dict[str, Any]:
    return {
        "index": int(g.index),
        "uuid": g.uuid,
        "name": g.name,
        "memory_mib": int(g.memory_mib),
        "mig_mode": g.mig_mode or "unsupported",
        "mig_mode_pending": g.mig_mode_pending,
        "mig_switching": bool(g.mig_switching),
        "mig_switch_error": g.mig_switch_error,
        "mig_instances": [
            {
                "profile": i.profile,
                "start": int(i.start),
                "size": int(i.size),
                "uuid": i.uuid,
                "managed": bool(i.managed),
                "gpu_instance_id": int(i.gpu_instance_id),
                "compute_instance_id": int(i.compute_instance_id),
            }
            for i in g.mig_instances
        ],
    }


def parse_states(states: Iterable[str | JobState] | str | JobState | None) -> list[JobState]:
    """Normalise a state filter (one state, several, or None) to a list of :class:`JobState`."""
    if states is None:
        return []
    if isinstance(states, (str, JobState)):
        states = [states]
    return [JobState.parse(s) for s in states]


@dataclass(frozen=True)
class QueueInfo:
    """A queue (``phalanx queue``): its quotas per GPU flavor, cohort, weight and tenants; what it uses now, its
    weighted dominant share, and its pending jobs in the order the scheduler would serve them."""

    name: str
    cohort: str = ""
    weight: float = 1.0
    quotas: tuple[dict[str, Any], ...] = ()  # {"flavor", "gpus", "borrow_limit" (None: none), "mig_slices"}
    tenants: tuple[str, ...] = ()
    usage: tuple[dict[str, Any], ...] = ()  # {"flavor", "gpus", "mig_slices", "borrowing"}
    share: float = 0.0
    running: int = 0
    pending: tuple[dict[str, Any], ...] = ()  # {"job_id", "name", "position", "priority", "message"}
    max_priority: int = 0  # the highest priority its jobs may ask for unless an admin submits them

    @classmethod
    def from_proto(cls, msg: Any) -> QueueInfo:
        spec = msg.spec
        return cls(
            name=spec.name,
            cohort=spec.cohort,
            weight=float(spec.weight or 1.0),
            quotas=tuple(
                {
                    "flavor": q.flavor,
                    "gpus": q.gpus,
                    "mig_slices": int(q.mig_slices),
                    "borrow_limit": q.borrow_limit if q.has_borrow_limit else None,
                }
                for q in spec.quotas
            ),
            tenants=tuple(spec.tenants),
            max_priority=int(spec.max_priority),
            usage=tuple(
                {"flavor": u.flavor, "gpus": u.gpus, "mig_slices": int(u.mig_slices), "borrowing": bool(u.borrowing)}
                for u in msg.usage
            ),
            share=float(msg.share),
            running=int(msg.running),
            pending=tuple(
                {
                    "job_id": p.job_id,
                    "name": p.name,
                    "position": int(p.position),
                    "priority": int(p.priority),
                    "message": p.message,
                }
                for p in msg.pending
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cohort": self.cohort,
            "weight": self.weight,
            "quotas": list(self.quotas),
            "tenants": list(self.tenants),
            "max_priority": self.max_priority,
            "usage": list(self.usage),
            "share": self.share,
            "running": self.running,
            "pending": list(self.pending),
        }
