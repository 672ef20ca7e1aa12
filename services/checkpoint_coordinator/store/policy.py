"""The checkpoint interval policy: measure the cluster's node failures and the checkpoint cost, then compute a
job's Young/Daly interval (phalanx.core.checkpoint_policy). The cluster-wide figures and the ranks' polls are
cached briefly, per database.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, case, func, select

from db.models import (
    Allocation,
    Checkpoint,
    Job,
    Node,
    NodeEvent,
)
from phalanx.core import checkpoint_policy as cp
from services.common.errors import InvalidArgument, NotFound

from ._records import COMMITTED, _possible_job_id

FATAL = "FATAL"  # node_events severity of a node loss (heartbeat lease expired) or a fatal GPU error


def checkpoint_policy(engine: Engine, job_id: str) -> cp.CheckpointPolicy:
    """The job's suggested checkpoint interval and the measured figures behind it (docs/design.md, "Checkpoint
    interval policy")."""
    if not job_id:
        raise InvalidArgument("job_id is required")
    with engine.execution_options(readonly=True).begin() as conn:
        if not _possible_job_id(job_id):
            raise NotFound(f"job {job_id[:80]!r} not found")
        current = conn.scalar(select(Job.attempt).where(Job.id == job_id))
        if current is None:
            raise NotFound(f"job {job_id[:80]!r} not found")
        return _policy(conn, job_id, current)


def _durations(conn, job_id: str | None, limit: int) -> list[float]:
    """committed_at - created_at of the latest `limit` COMMITTED checkpoints (of one job, or of any) that took
    measurable time: one recorded in a single call (RecordCheckpoint) has created_at == committed_at."""
    duration = Checkpoint.committed_at - Checkpoint.created_at
    query = select(duration).where(Checkpoint.state == COMMITTED, Checkpoint.committed_at > Checkpoint.created_at)
    if job_id is not None:
        query = query.where(Checkpoint.job_id == job_id)
    return [float(d) for d in conn.scalars(query.order_by(Checkpoint.committed_at.desc()).limit(limit))]


def _policy(conn, job_id: str, attempt: int) -> cp.CheckpointPolicy:
    """Measure the cluster's failures and the checkpoint cost, then compute the job's interval.

    failures: node_events of severity FATAL (the scheduler writes kind LOST when a heartbeat lease expires; fatal
    GPU errors arrive as FATAL health events); exposure: the sum over nodes of max(0, last_heartbeat -
    registered_at); nodes: the distinct nodes of the attempt's unreleased allocations (1 when none)."""
    events, seconds, cluster_durations = _cluster_figures(conn)
    nodes = (
        conn.scalar(
            select(func.count(func.distinct(Allocation.node_id))).where(
                Allocation.job_id == job_id,
                Allocation.attempt == attempt,
                Allocation.released_at.is_(None),
                Allocation.replica >= 0,  # the gang's own nodes: a spare's failure does not interrupt it
            )
        )
        or 0
    )
    return cp.compute_policy(
        events=int(events),
        node_hours=float(seconds) / cp.HOUR_S,
        nodes=max(1, int(nodes)),
        job_durations=_durations(conn, job_id, cp.JOB_COST_SAMPLES),
        cluster_durations=cluster_durations,
    )


# Every rank polls the policy (GetCheckpointRequest): the cluster-wide figures, which scan node_events and nodes,
# are shared by all of them and kept this long per database.
CLUSTER_FIGURES_TTL_S = 30.0
_cluster_cache: dict[str, tuple[float, tuple[int, float, list[float]]]] = {}  # key: (computed at, figures)


# While a request's step is agreed, every rank polls at every step: the polls share the job's policy too, for as
# long (GetCheckpointPolicy still computes it per call).
_poll_policy_cache: dict[tuple[str, str, int], tuple[float, cp.CheckpointPolicy]] = {}
POLL_POLICY_CACHE_MAX = 10_000


def _poll_policy(conn, job_id: str, attempt: int) -> cp.CheckpointPolicy:
    """The job's policy for a rank's poll (`_policy`), cached for CLUSTER_FIGURES_TTL_S per job and attempt."""
    key = (conn.engine.url.render_as_string(hide_password=True), job_id, attempt)
    now = time.monotonic()
    hit = _poll_policy_cache.get(key)
    if hit is not None and now - hit[0] < CLUSTER_FIGURES_TTL_S:
        return hit[1]
    policy = _policy(conn, job_id, attempt)
    if len(_poll_policy_cache) >= POLL_POLICY_CACHE_MAX:
        stale = [k for k, (at, _) in _poll_policy_cache.items() if now - at >= CLUSTER_FIGURES_TTL_S]
        for k in stale or list(_poll_policy_cache):
            del _poll_policy_cache[k]
    _poll_policy_cache[key] = (now, policy)
    return policy


def _cluster_figures(conn) -> tuple[int, float, list[float]]:
    """(FATAL node events, node-seconds alive, durations of the cluster's recent commits), cached briefly."""
    key = conn.engine.url.render_as_string(hide_password=True)
    now = time.monotonic()
    hit = _cluster_cache.get(key)
    if hit is not None and now - hit[0] < CLUSTER_FIGURES_TTL_S:  # the TTL in force now (a test may set 0)
        return hit[1]
    events = conn.scalar(select(func.count()).select_from(NodeEvent).where(NodeEvent.severity == FATAL)) or 0
    alive = Node.last_heartbeat - Node.registered_at
    seconds = conn.scalar(select(func.sum(case((alive > 0, alive), else_=0.0)))) or 0.0
    figures = (int(events), float(seconds), _durations(conn, None, cp.CLUSTER_COST_SAMPLES))
    _cluster_cache[key] = (now, figures)
    return figures
