"""The checkpoint interval policy: how often a gang should checkpoint. Pure: no I/O.

The interval is Young's first-order optimum (Young 1974; Daly 2006 derives it again and refines it):

    interval = sqrt(2 x MTBF x C)

where C is the time one checkpoint costs and MTBF the gang's mean time between failures. Checkpointing more often
wastes time writing checkpoints; less often, time recomputing the work lost at a failure: this interval minimises
the sum to first order (valid while C is much smaller than MTBF). `daly_interval` gives Daly's higher-order form,
sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C for C < 2M, else M; it is an option
(`interval(..., method="daly")`): the default is Young's, as issue 5 specifies.

The inputs (also in docs/design.md, "Checkpoint interval policy"):

- The failure rate is measured cluster-wide as node-loss events (FATAL node events) over node-hours (the time
  nodes have been alive), with a documented prior (`FailurePrior`): the node MTBF estimate is
  (prior node-hours + observed node-hours) / (prior events + observed events). That is the inverse of the
  posterior mean of a Poisson failure rate under a Gamma(alpha=events, beta=node-hours) prior, so with no data it
  is the prior's MTBF and with many events the data dominates.
- Failures of nodes are taken as independent, so a gang spanning n nodes fails n times as often: its MTBF is the
  node MTBF / n.
- The cost is the mean measured duration of recent committed checkpoints: the job's own, else the cluster's,
  else `PRIOR_COST_S`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

HOUR_S = 3600.0

# The prior cost of one checkpoint when none has been measured, in seconds: a multi-GB shard per rank written to
# local NVMe or a parallel file system takes tens of seconds, and an over-estimate errs towards checkpointing
# less often, not more.
PRIOR_COST_S = 60.0

# How many recent committed checkpoints the cost estimate averages: the job's own, else the cluster's.
JOB_COST_SAMPLES = 5
CLUSTER_COST_SAMPLES = 20

YOUNG = "young"
DALY = "daly"
METHODS = (YOUNG, DALY)


def _check(name: str, value: float, *, positive: bool = False) -> float:
    """`value` as a float; ValueError when it is NaN, infinite, negative, or (positive=True) zero."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return v


@dataclass(frozen=True)
class FailurePrior:
    """Pseudo-counts added to the measured failures: `events` node-loss events over `node_hours` node-hours.

    The default, 2 events over 12,000 node-hours (a node MTBF of 6,000 h), is worth two observed failures, so a
    few real ones outweigh it. Its source: Meta's Llama 3 report (Dubey et al. 2024, "The Llama 3 Herd of Models",
    section 3.3.4) counts 419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs, i.e.
    2,048 nodes of 8: 2,048 x 54 x 24 = 2,654,208 node-hours / 419 = ~6,300 node-hours per interruption, rounded
    down to 6,000 (erring towards checkpointing more often).
    """

    events: float = 2.0
    node_hours: float = 12_000.0

    def __post_init__(self) -> None:
        _check("prior events", self.events, positive=True)
        _check("prior node_hours", self.node_hours, positive=True)

    @property
    def node_mtbf_s(self) -> float:
        return self.node_hours * HOUR_S / self.events


DEFAULT_PRIOR = FailurePrior()


@dataclass(frozen=True)
class CheckpointPolicy:
    """A suggested checkpoint interval for one job, with every figure it came from."""

    interval_s: float  # the suggested time between checkpoints
    mtbf_s: float  # the job's MTBF: node_mtbf_s / nodes
    node_mtbf_s: float  # the estimated MTBF of one node (prior + measurements)
    cost_s: float  # the estimated time one checkpoint costs
    nodes: int  # nodes the job's gang spans
    events: int  # node-loss events observed cluster-wide
    node_hours: float  # node-hours observed cluster-wide
    cost_samples: int  # checkpoints the cost is the mean of (0: the prior)
    cost_source: str  # "job", "cluster" or "prior"
    mtbf_source: str  # "prior" (no node-hours or events observed) or "measured+prior"
    method: str = YOUNG  # "young" (sqrt(2 M C)) or "daly" (the higher-order form)
    prior_events: float = DEFAULT_PRIOR.events
    prior_node_hours: float = DEFAULT_PRIOR.node_hours


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """sqrt(2 x MTBF x C): Young's optimum checkpoint interval (Daly's first-order estimate), in seconds."""
    c = _check("checkpoint cost_s", cost_s, positive=True)
    m = _check("mtbf_s", mtbf_s, positive=True)
    return math.sqrt(2.0 * m * c)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum: sqrt(2CM)[1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M."""
    c = _check("checkpoint cost_s", cost_s, positive=True)
    m = _check("mtbf_s", mtbf_s, positive=True)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def interval(cost_s: float, mtbf_s: float, method: str = YOUNG) -> float:
    if method == YOUNG:
        return young_daly_interval(cost_s, mtbf_s)
    if method == DALY:
        return daly_interval(cost_s, mtbf_s)
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def node_mtbf_s(events: int, node_hours: float, prior: FailurePrior = DEFAULT_PRIOR) -> float:
    """A node's MTBF in seconds: (prior node-hours + node_hours) / (prior events + events), x 3600.

    The inverse of the posterior mean failure rate of a Poisson process with a Gamma(prior.events,
    prior.node_hours) prior after `events` failures in `node_hours` of exposure.
    """
    e = _check("events", events)
    h = _check("node_hours", node_hours)
    return (prior.node_hours + h) / (prior.events + e) * HOUR_S


def job_mtbf_s(node_mtbf: float, nodes: int) -> float:
    """The MTBF of a gang spanning `nodes` nodes whose failures are independent: node MTBF / nodes."""
    m = _check("node_mtbf_s", node_mtbf, positive=True)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    return m / nodes


def estimate_cost(
    job_durations: Iterable[float], cluster_durations: Iterable[float], prior_cost_s: float = PRIOR_COST_S
) -> tuple[float, str, int]:
    """(cost_s, source, samples): the job's mean measured duration, else the cluster's, else the prior.

    Durations of zero say nothing about the cost (a checkpoint recorded in one call) and are left out, so the
    estimate is never 0.
    """
    prior = _check("prior_cost_s", prior_cost_s, positive=True)
    for source, durations in (("job", job_durations), ("cluster", cluster_durations)):
        measured = [d for d in (_check("checkpoint duration", d) for d in durations) if d > 0]
        if measured:
            return sum(measured) / len(measured), source, len(measured)
    return prior, "prior", 0


def compute_policy(
    *,
    events: int,
    node_hours: float,
    nodes: int = 1,
    job_durations: Iterable[float] = (),
    cluster_durations: Iterable[float] = (),
    prior: FailurePrior = DEFAULT_PRIOR,
    prior_cost_s: float = PRIOR_COST_S,
    method: str = YOUNG,
) -> CheckpointPolicy:
    """The suggested interval for a job spanning `nodes` nodes, from the cluster's measured failures and the
    measured checkpoint durations (seconds)."""
    if isinstance(events, bool) or not isinstance(events, int) or events < 0:
        raise ValueError(f"events must be an integer >= 0, got {events!r}")
    node_mtbf = node_mtbf_s(events, node_hours, prior)
    mtbf = job_mtbf_s(node_mtbf, nodes)
    cost, cost_source, samples = estimate_cost(job_durations, cluster_durations, prior_cost_s)
    return CheckpointPolicy(
        interval_s=interval(cost, mtbf, method),
        mtbf_s=mtbf,
        node_mtbf_s=node_mtbf,
        cost_s=cost,
        nodes=nodes,
        events=events,
        node_hours=float(node_hours),
        cost_samples=samples,
        cost_source=cost_source,
        mtbf_source="measured+prior" if events or node_hours else "prior",
        method=method,
        prior_events=prior.events,
        prior_node_hours=prior.node_hours,
    )
