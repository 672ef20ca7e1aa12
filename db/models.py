"""The ledger: SQLAlchemy 2 models shared by the scheduler and the checkpoint coordinator.

The one invariant the database itself enforces: a GPU is held by at most one active allocation
(`uq_allocations_active_gpu`, a partial unique index portable to SQLite and PostgreSQL). Every gang
reservation inserts all of its allocation rows in one transaction, so a gang holds all its GPUs or none.
The same index covers partial GPUs: it is unique on (GPU, unit), where a whole GPU is unit -1 and a MIG
instance takes one row per memory slice (units 0-7); a GPU split into instances or shares is held whole by
one `hold` row, so no whole-GPU job can take it (see `Allocation`).
Times are unix seconds (double precision).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, float: Double}


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(253), unique=True)
    state: Mapped[str] = mapped_column(String(16))  # READY, DRAINED, LOST
    message: Mapped[str] = mapped_column(Text, default="")
    gpus: Mapped[int] = mapped_column(Integer)
    gpu_model: Mapped[str] = mapped_column(String(128), default="")
    profile: Mapped[str] = mapped_column(String(128), default="")
    address: Mapped[str] = mapped_column(String(255), default="")
    topology: Mapped[dict[str, Any]] = mapped_column(default=dict)
    fabric_path: Mapped[list[Any]] = mapped_column(default=list)
    agent_instance: Mapped[str] = mapped_column(String(64), default="")
    registered_at: Mapped[float] = mapped_column()
    last_heartbeat: Mapped[float] = mapped_column()
    # Assignment revisions are per node; bumping this row serialises them in commit order.
    revision: Mapped[int] = mapped_column(BigInteger, default=0)
    acked_revision: Mapped[int] = mapped_column(BigInteger, default=0)
    # Health from the agent's heartbeats (services/node_agent/health.py): HEALTHY, DEGRADED or FATAL, and
    # {"reason": "...", "gpus": {"3": {"state": "FATAL", "reasons": ["XID 79: ..."]}}} (only GPUs not HEALTHY).
    # Written only when it changes. A FATAL GPU is out of placement; a FATAL node is unschedulable.
    # An admin drained it (`phalanx node drain`, revision 0007): it stays DRAINED, also when its agent registers
    # again, until `phalanx node undrain`.
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    health: Mapped[str] = mapped_column(String(16), default="HEALTHY", server_default="HEALTHY")
    health_detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Times a rank could not be set up on this host (a retryable FAILED_TO_START: a MIG instance or the MPS daemon;
    # revision 0010). The job it struck avoids the node while it fits elsewhere (jobs.struck_nodes).
    strikes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The agent registered with --mig-manage (revision 0011): the scheduler may ask it to switch idle GPUs' MIG mode.
    mig_manage: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    containment: Mapped[str] = mapped_column(String(16), default="", server_default="")
    # Its agent says when an ended attempt's processes on it are gone: until then their GPUs stay held (releasing).
    confirms_release: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The ports its agent lets MASTER_PORT be chosen from (--rank-port-range); 0: the default range.
    rank_port_low: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    rank_port_high: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Host resources (revision 0020): CPUs (thousandths) and memory (bytes) its agent reported, and what active
    # allocations hold of them, raised by a guarded update at reservation (ledger.insert_allocations).
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    memory: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cpu_used: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    memory_used: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Where its agent serves its ranks' logs (revision 0021): AgentLogs on `address`:logs_port; 0 none
    logs_port: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class NodeEvent(Base):
    """A health event an agent reported (an XID, ECC errors, a lost GPU, ...), kept for operators."""

    __tablename__ = "node_events"
    __table_args__ = (Index(None, "node_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    at: Mapped[float] = mapped_column()
    gpu: Mapped[int] = mapped_column(Integer, default=-1)  # -1: the node
    severity: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(32))
    code: Mapped[int] = mapped_column(BigInteger, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")


class Gpu(Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(64), default="")
    name: Mapped[str] = mapped_column(String(128), default="")
    memory_mib: Mapped[int] = mapped_column(BigInteger, default=0)
    # MIG mode as the agent registered it (revision 0010): ENABLED (takes only MIG instances), DISABLED or
    # UNSUPPORTED (take whole-GPU jobs and shares, never MIG); and the MIG instances present then, as
    # [{"profile", "start", "size", "uuid", "managed", "gpu_instance_id", "compute_instance_id"}]. Instances with
    # managed false were made by someone else: their slices are out of placement.
    mig_mode: Mapped[str] = mapped_column(String(16), default="UNSUPPORTED", server_default="UNSUPPORTED")
    mig_instances: Mapped[list[Any]] = mapped_column(default=list)
    # MIG mode switches of --mig-manage agents (revision 0011). `mig_mode_pending`: the mode the agent reports
    # pending until a GPU reset applies it ("" none, else ENABLED / DISABLED). The switch the scheduler asked:
    # `mig_switch_to` the target mode ("" none), when, and its SetMigMode assignment's revision; under way while
    # `mig_switch_error` is empty, else failed with the agent's error and not asked again before `mig_retry_after`.
    # `mig_switched_at`: when the mode last changed as the scheduler saw it (--mig-switch-hold).
    mig_mode_pending: Mapped[str] = mapped_column(String(16), default="", server_default="")
    mig_switch_to: Mapped[str] = mapped_column(String(16), default="", server_default="")
    mig_switch_at: Mapped[float] = mapped_column(default=0.0, server_default="0")
    mig_switch_revision: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    mig_switch_error: Mapped[str] = mapped_column(Text, default="", server_default="")
    mig_retry_after: Mapped[float] = mapped_column(default=0.0, server_default="0")
    mig_switched_at: Mapped[float] = mapped_column(default=0.0, server_default="0")


# What the goodput read takes of a job not accounted (services/scheduler/accounting.py), besides `attempt`
GOODPUT_JOB_COLUMNS = (
    "id",
    "state",
    "submitted_at",
    "finished_at",
    "replicas",
    "gpus_per_replica",
    "mig_profile",
    "gpu_milli",
    "tenant",
    "queue",
)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index(None, "state", "priority", "submitted_at"),
        Index(None, "submitted_at"),
        Index(None, "submitted_at", "id"),  # ListJobs' pages (revision 0017; services/scheduler/paging.py)
        Index(None, "tenant", "submitted_at"),
        Index(None, "state", "finished_at"),  # the finished jobs due for the archive (revision 0016)
        Index(None, "service", "state"),  # a service's replicas (revision 0023)
        Index(None, "array_parent", "array_task"),  # an array's tasks (revision 0024)
        # The jobs not accounted (revision 0016): the goodput total reads these, whatever the number of finished ones;
        # on PostgreSQL with what it reads of them (revision 0025: an index-only scan, never the whole table).
        Index(
            "ix_jobs_unaccounted_submitted_at",
            "submitted_at",
            sqlite_where=text("accounted = 0"),
            postgresql_where=text("NOT accounted"),
            postgresql_include=[*(c for c in GOODPUT_JOB_COLUMNS if c != "submitted_at"), "attempt"],
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True, nullable=True)
    name: Mapped[str] = mapped_column(String(253))
    state: Mapped[str] = mapped_column(String(16))  # PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED
    priority: Mapped[int] = mapped_column(BigInteger, default=0)
    replicas: Mapped[int] = mapped_column(Integer)
    gpus_per_replica: Mapped[int] = mapped_column(Integer)
    procs_per_replica: Mapped[int] = mapped_column(Integer, default=0)
    command: Mapped[list[Any]] = mapped_column()
    env: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    message: Mapped[str] = mapped_column(Text, default="")
    exit_code: Mapped[int] = mapped_column(Integer, default=0)
    placement: Mapped[dict[str, Any]] = mapped_column(default=dict)
    submitted_at: Mapped[float] = mapped_column()
    started_at: Mapped[float] = mapped_column(default=0.0)
    finished_at: Mapped[float] = mapped_column(default=0.0)
    # Topology constraints by tier name ("node", a fabric tier, "cluster"); "" means none (revision 0002).
    required_tier: Mapped[str] = mapped_column(String(64), default="", server_default="")
    preferred_tier: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # GPU model filter and partial GPUs (revision 0003): see phalanx.v1.JobSpec.
    gpu_model: Mapped[str] = mapped_column(String(128), default="", server_default="")
    mig_profile: Mapped[str] = mapped_column(String(32), default="", server_default="")
    gpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Optimistic concurrency: every state change is `UPDATE ... WHERE version = :seen`.
    version: Mapped[int] = mapped_column(Integer, default=0)
    # Recovery (revision 0006). `failures`: attempts torn down by a failure (the retry limit counts these, not
    # preemptions). `not_before`: a requeued job waits for its retry backoff until then. A victim of a preemption
    # stays RUNNING with `preempted_by` (the preemptor) and `preempt_deadline` (stopped then at the latest).
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    not_before: Mapped[float] = mapped_column(default=0.0, server_default="0")
    preempted_by: Mapped[str] = mapped_column(String(32), default="", server_default="")
    preempt_deadline: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # A rank exiting non-zero requeues the gang this many times (counted as failures); 0: it fails the job.
    max_restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Tenancy and time limits (revision 0007): the submitting tenant ("" with authentication off), and the
    # declared runtime in seconds (0: none), enforced, and what backfill plans with.
    tenant: Mapped[str] = mapped_column(String(64), default="", server_default="")
    time_limit: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # The queue it was submitted to (revision 0008): its quota, cohort and fair share apply.
    queue: Mapped[str] = mapped_column(String(64), default="default", server_default="default")
    flavor: Mapped[str] = mapped_column(String(64), default="", server_default="")  # admitted under this quota flavor
    # Nodes that struck it (revision 0010): their host could not set up one of its ranks (a retryable
    # FAILED_TO_START); its placements avoid them while it fits elsewhere.
    struck_nodes: Mapped[list[Any]] = mapped_column(default=list)
    # Checkpoint retention (revision 0014): the checkpoint coordinator keeps this many of its newest complete
    # committed checkpoints (JobSpec.keep_checkpoints); 0: the coordinator's --keep-checkpoints.
    keep_checkpoints: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Goodput (revision 0016): finished, and its figures and count are in goodput_totals, added by the leader's
    # upkeep soon after it finished (services/scheduler/accounting.py account_finished); the goodput total reads
    # from `jobs` only the jobs not accounted.
    accounted: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Host resources of each replica (revision 0020; JobSpec.cpus_per_replica, memory_per_replica): thousandths of
    # CPUs and bytes, 0 none.
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    memory: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Submitted by an admin (revision 0021; every caller is one with authentication off): it may preempt other
    # queues' jobs by priority; other jobs only take back quota those queues borrowed.
    by_admin: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # Serving (revision 0023): the service it is a replica of ("" none), and what the gang asked for serving
    # (roles, start_order, ready_probe, restart, and for a replica its service_replica, service_revision,
    # spread_tier, surge); `ready`: its leader's readiness probe passes now (ready_at: since when).
    service: Mapped[str] = mapped_column(String(64), default="", server_default="")
    serving: Mapped[dict[str, Any]] = mapped_column(default=dict)
    ready: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    ready_at: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # Frontier-scale training (revision 0024). `shape`: how the gang is cut and kept ({"segment", "segment_tier",
    # "spares_per_segment", "min_replicas"}; {} a plain gang). Job graphs: `after`, the jobs it waits for
    # ([{"job_id", "condition"}]); `array`, an array's spec and progress on its parent row; `array_parent` and
    # `array_task`, a task's array and index ("" and -1 for a job that is not an array task).
    shape: Mapped[dict[str, Any]] = mapped_column(default=dict)
    after: Mapped[list[Any]] = mapped_column(default=list)
    array: Mapped[dict[str, Any]] = mapped_column(default=dict)
    array_parent: Mapped[str] = mapped_column(String(32), default="", server_default="")
    array_task: Mapped[int] = mapped_column(Integer, default=-1, server_default="-1")


class Queue(Base):
    """A queue's quotas (revision 0008; phalanx.core.quota): `quotas` maps a GPU flavor (a GPU model such as
    "H100", or "*" for any) to {"gpus": nominal, "borrow_limit": max borrowed (absent: no limit), "mig_slices":
    nominal MIG compute slices}; queues of one `cohort` lend each other their unused nominal quota; `weight` is its
    fair share; `tenants` who may submit to it (empty: anyone)."""

    __tablename__ = "queues"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    cohort: Mapped[str] = mapped_column(String(64), default="", server_default="")
    weight: Mapped[float] = mapped_column(default=1.0, server_default="1")
    quotas: Mapped[dict[str, Any]] = mapped_column(default=dict)
    tenants: Mapped[list[Any]] = mapped_column(default=list)
    updated_at: Mapped[float] = mapped_column()
    # The highest priority its jobs may ask for unless an admin submits them (revision 0021)
    max_priority: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class SparePool(Base):
    """An operator's spare pool (revision 0024; phalanx.core.pools): `per_domain` whole nodes kept idle in each
    domain of `tier` for any gang there that loses a node; `booked` maps each domain to the nodes booked there now
    (lent to backfill jobs with time limits meanwhile)."""

    __tablename__ = "spare_pools"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    tier: Mapped[str] = mapped_column(String(64))
    per_domain: Mapped[int] = mapped_column(Integer)
    booked: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[float] = mapped_column()
    updated_at: Mapped[float] = mapped_column()


class Service(Base):
    """A serving fleet (revision 0023): K replicas of `revision`'s template, each a job whose `service` names it.
    `spec`: the rest of its ServiceSpec (spread tier, rollout bounds, autoscaler, port) as JSON; `replicas` is K.
    A deleted service keeps its row (`deleted_at`) and revisions until its name is used again."""

    __tablename__ = "services"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default="", server_default="")
    revision: Mapped[int] = mapped_column(Integer)
    replicas: Mapped[int] = mapped_column(Integer)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    message: Mapped[str] = mapped_column(Text, default="", server_default="")
    autoscaler: Mapped[str] = mapped_column(Text, default="", server_default="")
    created_at: Mapped[float] = mapped_column()
    updated_at: Mapped[float] = mapped_column()
    deleted_at: Mapped[float | None] = mapped_column(nullable=True)
    version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ServiceRevision(Base):
    """Every revision of a service's replica template (a JobSpec as JSON), kept for rollback and history."""

    __tablename__ = "service_revisions"

    service: Mapped[str] = mapped_column(ForeignKey("services.name", ondelete="CASCADE"), primary_key=True)
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    template: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[float] = mapped_column()
    cause: Mapped[str] = mapped_column(Text, default="", server_default="")


class ServiceEndpoint(Base):
    """Where a service can be reached, written by the service at start: the scheduler finds the checkpoint
    coordinator here when no flag names it (`detail`: e.g. the checkpoint directory it serves)."""

    __tablename__ = "service_endpoints"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    address: Mapped[str] = mapped_column(String(255))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    updated_at: Mapped[float] = mapped_column()


class JobAttempt(Base):
    """One launch of a gang, for goodput accounting (phalanx.core.goodput).

    Written by the scheduler: the row at the reservation, `running_at` when every rank runs, the end when it is
    torn down. `committed_step` is the job's latest committed checkpoint step at the end and `kept_until` the time
    that step was reached in this attempt (its checkpoint's created_at), NULL when no checkpoint of this attempt
    committed: the work after it is rolled back. `gpus` counts GPU equivalents (a MIG instance or a share is a
    fraction of one).
    """

    __tablename__ = "job_attempts"
    __table_args__ = (Index(None, "ended_at"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpus: Mapped[float] = mapped_column()
    reserved_at: Mapped[float] = mapped_column()
    running_at: Mapped[float | None] = mapped_column(nullable=True)
    ended_at: Mapped[float | None] = mapped_column(nullable=True)
    # SUCCEEDED, FAILED, CANCELLED, PREEMPTED, NODE_LOST, NODE_DRAINED, GPU_FAILED, RANK_LOST, RANK_FAILED,
    # SETUP_FAILED, LAUNCH_TIMEOUT, TIMEOUT; "" while running
    outcome: Mapped[str] = mapped_column(String(16), default="", server_default="")
    reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    restored_step: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    committed_step: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    kept_until: Mapped[float | None] = mapped_column(nullable=True)
    # The gang this attempt was preempted for (revision 0022; "" when it ended otherwise)
    preempted_by: Mapped[str] = mapped_column(String(32), default="", server_default="")


class Claim(Base):
    """A preemptor's claim on the capacity its victims free (revision 0022; phalanx.core.claims): made when its
    victims are asked to stop, standing (`ended_at` NULL) until it runs, leaves the queue or can no longer fit where
    it claimed, then kept with `end_reason`. At most one standing claim per job. `replicas`: where the preemptor
    goes, [{"node", "gpus", "mig_profile", "mig_start", "mig_size", "gpu_milli", "cpu_milli", "memory"}];
    `victims`: the job ids asked to stop for it; `queue` and `flavor`: the quota it keeps ("" none)."""

    __tablename__ = "claims"
    __table_args__ = (
        Index(None, "job_id"),
        Index(
            "uq_claims_standing_job",
            "job_id",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    priority: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    queue: Mapped[str] = mapped_column(String(64), default="", server_default="")
    flavor: Mapped[str] = mapped_column(String(64), default="", server_default="")
    replicas: Mapped[list[Any]] = mapped_column()
    victims: Mapped[list[Any]] = mapped_column()
    created_at: Mapped[float] = mapped_column()
    ended_at: Mapped[float | None] = mapped_column(nullable=True)
    end_reason: Mapped[str] = mapped_column(Text, default="", server_default="")


class Allocation(Base):
    """One GPU, or part of one, held by one replica. Active while released_at IS NULL.

    `kind`: `gpu` a whole GPU (unit -1); `mig` one memory slice (unit 0-7) of a MIG instance of `profile`;
    `share` a fractional share of `gpu_milli` thousandths (unit NULL: shares are not slices); `hold` the GPU
    itself while any instance or share is on it (unit -1, so it excludes whole-GPU rows; `gpu_milli` sums the
    shares, which a guarded update keeps at or under 1000). A hold row carries a job that holds part of the GPU:
    the one that opened it, then, when that one's parts go, one of those left.
    """

    __tablename__ = "allocations"
    __table_args__ = (
        Index(
            "uq_allocations_active_gpu",
            "gpu_id",
            "unit",
            unique=True,
            sqlite_where=text("released_at IS NULL"),
            postgresql_where=text("released_at IS NULL"),
        ),
        Index(None, "job_id", "attempt"),
        # The active rows by node (revision 0020): ledger.recount_use and the releases' give-back read them.
        Index(
            "ix_allocations_active_node",
            "node_id",
            sqlite_where=text("released_at IS NULL"),
            postgresql_where=text("released_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    replica: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id"))
    gpu_index: Mapped[int] = mapped_column(Integer)
    reserved_at: Mapped[float] = mapped_column()
    released_at: Mapped[float | None] = mapped_column(nullable=True)
    # Partial GPUs (revision 0003); whole-GPU rows keep the defaults.
    kind: Mapped[str] = mapped_column(String(8), default="gpu", server_default="gpu")
    unit: Mapped[int | None] = mapped_column(Integer, nullable=True, default=-1, server_default="-1")
    profile: Mapped[str] = mapped_column(String(32), default="", server_default="")
    gpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # A replica's host resources (revision 0020), on one row of the replica: released with it, they are given back
    # to the node's cpu_used / memory_used.
    cpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    memory: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Rank(Base):
    __tablename__ = "ranks"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica: Mapped[int] = mapped_column(Integer)
    local_rank: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    state: Mapped[str] = mapped_column(String(24))  # ASSIGNED, RUNNING, EXITED, FAILED_TO_START, KILLED, LOST
    exit_code: Mapped[int] = mapped_column(Integer, default=0)
    pid: Mapped[int] = mapped_column(Integer, default=0)
    message: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[float] = mapped_column()


class Assignment(Base):
    """The outbox of a node's assignment stream: a serialized phalanx.v1.Assignment per revision."""

    __tablename__ = "assignments"
    __table_args__ = (UniqueConstraint("node_id", "revision"), Index(None, "job_id"))  # job_id: revision 0016

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    revision: Mapped[int] = mapped_column(BigInteger)
    job_id: Mapped[str] = mapped_column(String(32))
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # launch, kill
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[float] = mapped_column()


class Checkpoint(Base):
    """A checkpoint of one attempt of a job. Retention (revision 0014, services/checkpoint_coordinator/retention.py):
    `deleted_at` is when the coordinator deleted its files (NULL: not deleted); the row keeps its state and shards
    for the record, and a deleted checkpoint is never a restore point."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        Index(None, "job_id", "state", "step"),
        # The undeleted rows, which the coordinator's retention sweep reads.
        Index(
            "ix_checkpoints_undeleted",
            "job_id",
            "state",
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))  # PENDING -> COMMITTED (every rank reported) or ABORTED
    created_at: Mapped[float] = mapped_column()
    committed_at: Mapped[float | None] = mapped_column(nullable=True)
    world_size: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # shards needed to commit
    deadline_at: Mapped[float | None] = mapped_column(nullable=True)  # a PENDING checkpoint aborts after this
    message: Mapped[str] = mapped_column(Text, default="", server_default="")  # why it aborted
    deleted_at: Mapped[float | None] = mapped_column(nullable=True)  # its files were deleted then (retention)


class CheckpointRequest(Base):
    """A pending ask (user, preemption, a rank's time policy) that the job's ranks checkpoint soon; cleared by the
    next commit. `target_step`: the step every rank of attempt `target_attempt` checkpoints at, decided by the
    coordinator once each of them reported its step (revision 0013; NULL until then, see CheckpointStepReport)."""

    __tablename__ = "checkpoint_requests"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    requested_at: Mapped[float] = mapped_column()
    target_attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class CheckpointStepReport(Base):
    """The step one rank of an attempt last reported while a checkpoint request was outstanding (revision 0013):
    the step it had just completed, for the request of `requested_at`. The coordinator replaces it at each report and
    decides the request's target step, max(step) + 1, once every rank 0..N-1 reported for the request; a commit that
    clears the request removes its reports. Written by the coordinator only."""

    __tablename__ = "checkpoint_step_reports"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger)
    requested_at: Mapped[float] = mapped_column()
    reported_at: Mapped[float] = mapped_column()


class CheckpointShard(Base):
    __tablename__ = "checkpoint_shards"

    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    checksum: Mapped[str] = mapped_column(String(128), default="")


class CheckpointRestore(Base):
    """What one rank of an attempt restored from (revision 0012), as its phalanx.train.restore() reported it to the
    checkpoint coordinator: the checkpoint (`checkpoint_id` "", `step` -1: it started from step 0) and the newer
    committed checkpoints it skipped because their files were missing or damaged (`skipped`: [{"checkpoint_id",
    "step", "reason"}], newest first; steps from the ledger). `message`: the one-line account
    ("restored from step S (step T was damaged: ...)"). Written by the coordinator only."""

    __tablename__ = "checkpoint_restores"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(String(32), default="", server_default="")
    step: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    skipped: Mapped[list[Any]] = mapped_column(default=list)
    message: Mapped[str] = mapped_column(Text, default="", server_default="")
    reported_at: Mapped[float] = mapped_column()


class LedgerClock(Base):
    """One row whose generation every scheduling transaction bumps when it writes.

    A replica that finds a generation other than the one it last wrote knows another process changed the ledger
    and reloads its view before deciding anything.
    """

    __tablename__ = "ledger_clock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    # Leadership (revision 0009): the replica that schedules, until when its lease runs, and the fencing epoch.
    leader: Mapped[str] = mapped_column(String(64), default="", server_default="")
    leader_epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    leader_until: Mapped[float] = mapped_column(default=0.0, server_default="0")


class LedgerIdentity(Base):
    """The ledger's identity (revision 0015): one row (id 1) whose `cluster_id`, a random UUID, is written when the
    database is created or upgraded (`phalanx db upgrade`, db.migrate.upgrade) and never changes after. The scheduler
    returns it at registration; a node agent whose saved state names another cluster id starts clean."""

    __tablename__ = "ledger_identity"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[str] = mapped_column(String(36))
    created_at: Mapped[float] = mapped_column()
    # The key of the ranks' credentials (revision 0021; phalanx.common.tokens.rank_token): the scheduler signs each
    # attempt's PHALANX_JOB_TOKEN with it, the checkpoint coordinator checks it. Written once, random.
    rank_key: Mapped[str] = mapped_column(String(64), default="", server_default="")


class LedgerChange(Base):
    """What the scheduling transaction that made `generation` changed in the rows the replicas' views hold
    (revision 0018; services.scheduler.ledger.Changes as JSON): another replica reloads only those rows. Rows
    older than ten minutes are deleted by the leader."""

    __tablename__ = "ledger_changes"

    generation: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    replica: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(index=True)
    body: Mapped[str] = mapped_column(Text)


class JobArchive(Base):
    """A finished job moved out of `jobs` by retention (revision 0016, services/scheduler/retention.py): one compact
    row per job, written in the transaction that deletes the job and its dependent rows. The goodput figures are the
    job's as computed when it was archived (phalanx.core.goodput; GPU-seconds); `attempts` counts its job_attempts
    rows; `detail` keeps the rest worth keeping: command, tiers, placement, failures, preemptions, flavor, the
    request id, and each attempt's number, outcome and reason. `phalanx db prune` deletes rows (after exporting them);
    their figures stay in goodput_totals."""

    __tablename__ = "job_archive"
    __table_args__ = (
        Index(None, "submitted_at", "id"),
        Index(None, "tenant", "submitted_at"),
        Index(None, "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(253))
    tenant: Mapped[str] = mapped_column(String(64), default="", server_default="")
    queue: Mapped[str] = mapped_column(String(64), default="default", server_default="default")
    state: Mapped[str] = mapped_column(String(16))  # SUCCEEDED, FAILED, CANCELLED
    priority: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    replicas: Mapped[int] = mapped_column(Integer)
    gpus_per_replica: Mapped[int] = mapped_column(Integer)
    mig_profile: Mapped[str] = mapped_column(String(32), default="", server_default="")
    gpu_milli: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    submitted_at: Mapped[float] = mapped_column()
    started_at: Mapped[float] = mapped_column(default=0.0, server_default="0")
    finished_at: Mapped[float] = mapped_column()
    exit_code: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    message: Mapped[str] = mapped_column(Text, default="", server_default="")
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    allocated: Mapped[float] = mapped_column(default=0.0, server_default="0")
    productive: Mapped[float] = mapped_column(default=0.0, server_default="0")
    rollback: Mapped[float] = mapped_column(default=0.0, server_default="0")
    restart: Mapped[float] = mapped_column(default=0.0, server_default="0")
    waiting: Mapped[float] = mapped_column(default=0.0, server_default="0")
    archived_at: Mapped[float] = mapped_column()
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class GoodputTotals(Base):
    """The summed goodput figures (GPU-seconds) and count of the archived jobs of one tenant and queue submitted on
    one UTC day (`day`: that day's start, unix seconds) (revision 0016). Added to in the transaction that archives
    the jobs, never subtracted from: `phalanx db prune` leaves these rows alone, so a cluster's goodput counts every
    job it ever ran. The scheduler's goodput (services/scheduler/accounting.py) is these sums plus the jobs still in
    `jobs`."""

    __tablename__ = "goodput_totals"
    __table_args__ = (Index(None, "day"),)

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    queue: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    jobs: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    allocated: Mapped[float] = mapped_column(default=0.0, server_default="0")
    productive: Mapped[float] = mapped_column(default=0.0, server_default="0")
    rollback: Mapped[float] = mapped_column(default=0.0, server_default="0")
    restart: Mapped[float] = mapped_column(default=0.0, server_default="0")
    waiting: Mapped[float] = mapped_column(default=0.0, server_default="0")
    updated_at: Mapped[float] = mapped_column()


ACTIVE_JOB_STATES = ("PENDING", "RUNNING")
TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
