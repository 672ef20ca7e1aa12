"""Prometheus metrics, exposed over HTTP only when a service is given --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPCS = Counter("phalanx_rpcs_total", "RPCs received", ["method"])
RPC_ERRORS = Counter("phalanx_rpc_errors_total", "RPCs answered with an error status", ["method", "code"])
RPC_LATENCY = Histogram("phalanx_rpc_latency_seconds", "Unary RPC handling time", ["method"])
QUEUE_DEPTH = Gauge("phalanx_queue_depth", "Pending jobs known to this scheduler replica")
GPUS_FREE = Gauge("phalanx_gpus_free", "Free GPUs on ready nodes")
GPUS_ALLOCATED = Gauge("phalanx_gpus_allocated", "GPUs held by running gangs")
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
VIEW_RELOADS = Counter(
    "phalanx_scheduler_view_reloads_total",
    "Reloads of the in-memory view from the ledger: full (start, leadership, a failed cycle) or delta (the rows "
    "another replica's cycles changed)",
    ["kind"],
)
RESERVATIONS = Counter("phalanx_reservations_total", "Gang reservations committed")
RESERVATION_CONFLICTS = Counter("phalanx_reservation_conflicts_total", "Reservations refused by the ledger")

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


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Expose /metrics on port when one is given; metrics stay off otherwise, so ports never collide."""
    if port:
        start_http_server(port, addr=host)
