"""Prometheus metrics, exposed over HTTP only when a service is given --metrics-port."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPCS = Counter("phalanx_rpcs_total", "RPCs received", ["method"])
RPC_ERRORS = Counter("phalanx_rpc_errors_total", "RPCs answered with an error status", ["method", "code"])
RPC_LATENCY = Histogram("phalanx_rpc_latency_seconds", "Unary RPC handling time", ["method"])
QUEUE_DEPTH = Gauge("phalanx_queue_depth", "Pending jobs known to this scheduler replica")
QUEUE_PENDING = Gauge(
    "phalanx_queue_pending_jobs",
    "Pending jobs per queue known to this scheduler replica (every configured queue, 0 while empty)",
    ["queue"],
)
GPUS_FREE = Gauge("phalanx_gpus_free", "Free GPUs on ready nodes")
GPUS_ALLOCATED = Gauge("phalanx_gpus_allocated", "GPUs held by running gangs (their ranks' and their spares')")
GPUS_SPARE = Gauge(
    "phalanx_gpus_spare", "GPUs running gangs hold idle as spares kept in the domain (part of phalanx_gpus_allocated)"
)
TENANT_GPUS_ALLOCATED = Gauge(
    "phalanx_tenant_gpus_allocated",
    "GPUs held by running gangs per tenant ('-': jobs submitted with authentication off); sums to "
    "phalanx_gpus_allocated",
    ["tenant"],
)
NODES = Gauge(
    "phalanx_nodes",
    "Registered nodes known to this scheduler replica by state (READY, DRAINED, LOST) and health (HEALTHY, "
    "DEGRADED, FATAL, UNKNOWN)",
    ["state", "health"],
)
RESERVATION_LATENCY = Histogram(
    "phalanx_reservation_latency_seconds",
    "Submit-to-reserved time of gangs reserved by this replica",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
GOODPUT = Gauge(
    "phalanx_goodput_gpu_seconds",
    "GPU-seconds of every job in the ledger by category: allocated, productive, rollback, restart, waiting",
    ["category"],
)
GOODPUT_RATIO = Gauge("phalanx_goodput_ratio", "Productive over allocated GPU time, whole cluster")
GC_PAUSE_SECONDS = Histogram(
    "phalanx_gc_pause_seconds",
    "Pauses of Python's garbage collector in this process, by generation (every thread stops meanwhile)",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
CYCLE_SECONDS = Histogram(
    "phalanx_scheduler_cycle_seconds",
    "Time of one scheduling cycle (its commands, timers and scheduling pass, in one transaction, commit included)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
)
ADMISSIONS = Counter(
    "phalanx_scheduler_admissions_total",
    "Batches of submits by where they were decided: `lane`, the admission lane on the arrivals alone (issue 35), or "
    "`pass`, a cycle's pass over the whole queue (the view was not settled, or no arrival was ahead of the queue); "
    "`accept`, a single submission behind a pending job of its priority or a higher one, written PENDING and "
    "answered before any cycle (the accept lane), then decided by a pass",
    ["path"],
)
ADMITTED_AT_SUBMIT = Counter(
    "phalanx_scheduler_admitted_at_submit_total",
    "Gangs the admission lane reserved in the transaction that wrote their submission",
)
STATUS_LANE_BATCH = Histogram(
    "phalanx_scheduler_status_lane_batch_seconds",
    "One transaction of a status lane, from its start to its commit, by lane: status (rank rows, node heartbeats and "
    "acks) or accept (accepted submissions); what a report or an accepted submission waits for at most twice (the "
    "batch in flight, then its own)",
    ["lane"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
)
RANK_REPORTS = Counter(
    "phalanx_scheduler_rank_reports_total",
    "Agents' rank reports by how they were taken: `lane`, recorded by the status lane and answered at its commit "
    "(issue 35); `answered`, answered from the view with nothing to write (stale, or a state the rank has); "
    "`cycle`, a cycle command (the view could not judge it, this replica does not lead, or --no-status-lane)",
    ["path"],
)
VIEW_RELOADS = Counter(
    "phalanx_scheduler_view_reloads_total",
    "Reloads of the in-memory view from the ledger: full (start, leadership, a failed cycle) or delta (the rows "
    "another replica's cycles changed)",
    ["kind"],
)
FENCES = Counter(
    "phalanx_scheduler_fences_total",
    "Scheduling transactions by how they held the ledger's clock row: lock (waited for it before deciding), "
    "pipeline (sent it, checked by the server, with the closing writes), waited (decided before it, then a guarded "
    "write of the cycle sent it alone and waited) or refused (the server found the ledger moved or the lease lost: "
    "rolled back, the view reloaded)",
    ["how"],
)
SERVICE_REPLICAS = Gauge(
    "phalanx_service_replicas",
    "Replicas of each service, by kind: desired (the count it aims at, the autoscaler's included), live (replica "
    "gangs pending or running) and ready; set by the leading replica's service controller, a deleted service's "
    "series removed",
    ["service", "kind"],
)
RESERVATIONS = Counter("phalanx_reservations_total", "Gang reservations committed")
RESERVATION_CONFLICTS = Counter("phalanx_reservation_conflicts_total", "Reservations refused by the ledger")
CHECKPOINT_COMMIT_SECONDS = Histogram(
    "phalanx_checkpoint_commit_seconds",
    "Time from a checkpoint's creation (the first rank's BeginCheckpoint or shard) to its commit (the last rank's "
    "shard), observed by the checkpoint coordinator that committed it",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
)

# Preemption cycles (Kueue issue 6861): how many times each active job was preempted (the label goes when the job
# finishes: bounded by the active jobs), and how many gangs each preemptor had asked to stop when it started.
JOB_PREEMPTIONS = Counter(
    "phalanx_job_preemptions_total",
    "Times each active job was preempted (stopped for another gang); its series ends when the job finishes",
    ["job"],
)
PREEMPTIONS_PER_ATTEMPT = Histogram(
    "phalanx_preemptions_per_attempt",
    "Gangs a preemptor had asked to stop when its attempt started (observed once per such attempt)",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)

SCHEDULER_LEADER = Gauge("phalanx_scheduler_leader", "1 while this scheduler replica holds the leadership lease")
SCHEDULER_LEADER_EPOCH = Gauge(
    "phalanx_scheduler_leader_epoch", "Fencing epoch of the leadership lease as this replica last saw it"
)
LEADERSHIP_CHANGES = Counter(
    "phalanx_scheduler_leadership_changes_total", "Leadership acquired or lost by this replica", ["event"]
)
FENCED = Counter(
    "phalanx_scheduler_fenced_total",
    "Scheduling passes and lease renewals of this replica refused by the epoch check "
    "(it believed it led, the ledger said another epoch)",
)


_SHOWN: dict[Gauge, set[tuple[str, ...]]] = {}


def set_groups(gauge: Gauge, values: Mapping[tuple[str, ...], float]) -> None:
    """Set a labeled gauge to `values` (label values -> value); the label sets it showed before and `values` no
    longer names read 0, so a drained queue shows 0 rather than its last depth. Keep the label values bounded by
    configuration (queues, tenants, node states), never by job."""
    shown = _SHOWN.setdefault(gauge, set())
    for labels in shown - values.keys():
        gauge.labels(*labels).set(0)
    for labels, value in values.items():
        gauge.labels(*labels).set(value)
    shown.update(values.keys())


def set_scheduler_groups(
    pending: Iterable[Any], running: Iterable[Any], nodes: Iterable[Any], queues: Iterable[str]
) -> None:
    """The gauges by queue, tenant and node state from a scheduler replica's view: `pending` and `running` job
    records (queue, tenant, allocations), node records (state, health), the configured queue names (none: the one
    queue "default")."""
    depth: dict[tuple[str, ...], float] = {(name,): 0 for name in queues} or {("default",): 0}
    for job in pending:
        depth[(job.queue,)] = depth.get((job.queue,), 0) + 1
    held: dict[tuple[str, ...], float] = {}
    for job in running:
        tenant = (job.tenant or "-",)
        held[tenant] = held.get(tenant, 0) + sum(len(gpus) for _, _, gpus in (*job.allocations, *job.spares))
    states: dict[tuple[str, ...], float] = {}
    for node in nodes:
        state = (node.state, node.health)
        states[state] = states.get(state, 0) + 1
    set_groups(QUEUE_PENDING, depth)
    set_groups(TENANT_GPUS_ALLOCATED, held)
    set_groups(NODES, states)


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Expose /metrics on port when one is given; metrics stay off otherwise, so ports never collide."""
    if port:
        start_http_server(port, addr=host)


def forget_jobs(job_ids: Iterable[str]) -> None:
    """Drop the per-job series of finished jobs (JOB_PREEMPTIONS), so that they stay bounded by the active ones."""
    for job_id in job_ids:
        try:
            JOB_PREEMPTIONS.remove(job_id)
        except KeyError:
            pass
