"""Elastic gangs in the scheduler service (the decision's side is phalanx.core.elastic): the shrink on a loss, the
preference for the nodes it still has, and the rank environment of its size.

Shrink. A node of a running elastic gang lost (or a fatal GPU error on one of its GPUs), with at least its minimum
of replicas still on usable nodes: the gang is torn down as usual (the checkpoint coordinator fences the attempt)
but requeued at once, without counting a failure or waiting out the retry backoff, and placed again in the same
cycle at the most replicas that fit (at least its minimum), preferring the nodes it still has. Fewer than its
minimum left: the usual failure path (counted, backed off), and it starts again once its minimum fits.
"""

from __future__ import annotations

from typing import Any

from phalanx.core.gang_recovery import elastic_gang
from phalanx.core.recovery import REQUEUE, decide_recovery

from .state import JobRecord, SchedulerState

SHRINK_CAUSES = ("NODE_LOST", "GPU_FAILED", "NODE_DRAINED")


def lost_replicas(state: SchedulerState, job: JobRecord) -> set[int]:
    """The replicas of its attempt on a node no longer usable, or on one of its unusable GPUs."""
    lost = set()
    for rep in job.replica_placements():
        node = state.nodes.get(rep.node)
        if node is None or not node.schedulable or set(rep.gpus) & node.held_gpus:
            lost.add(rep.replica)
    return lost


def shrink_changes(state: SchedulerState, job: JobRecord, cause: str, message: str) -> dict[str, Any] | None:
    """The teardown's changes for an elastic gang that shrinks instead of failing (None: it does not)."""
    if not job.min_replicas or cause not in SHRINK_CAUSES or job.serving.get("restart") == "never":
        return None
    # The shrink half of the recovery decision the simulator evaluates (phalanx.core.recovery; the swap half ran
    # first, in spares.swap_or_teardown): a shrink when the surviving replicas are at least its minimum.
    replicas = [r for r, _, _ in job.allocations]
    lost = lost_replicas(state, job) & set(replicas)  # (a spare lost with the node is no rank)
    if job.min_replicas > len(replicas):
        return None
    segment = int(job.shape.get("segment") or 0)  # a segmented gang shrinks by whole segments
    gang, failed = elastic_gang(job.id, replicas, job.min_replicas, lost, multiple=segment or 1)
    if decide_recovery(gang, failed, "elastic").action == REQUEUE:
        return None
    left = len(replicas) - len(lost)
    return dict(
        state="PENDING",
        not_before=0.0,
        message=(
            f"{message}; elastic: {left} of its {job.size} replicas are still up, so it restarts at once from its "
            f"last committed checkpoint with as many replicas as fit (at least {job.min_replicas}, at most "
            f"{job.replicas}), on the nodes it still has first"
        ),
    )


def elastic_env(job: JobRecord) -> dict[str, str]:
    """What ranks of an elastic gang are told of its size (torchrun's elastic variables included); {} otherwise.
    WORLD_SIZE (set for every gang) is the current attempt's."""
    if not job.min_replicas:
        return {}
    return {
        "PET_NNODES": f"{job.min_replicas}:{job.replicas}",
        "PHALANX_MIN_REPLICAS": str(job.min_replicas),
        "PHALANX_MAX_REPLICAS": str(job.replicas),
        "PHALANX_REPLICAS": str(len(job.allocations)),
    }


def elastic_below_max(state: SchedulerState) -> list[str]:
    """The running elastic gangs below their maximum: those that may grow."""
    return [j.id for j in state.jobs.in_state("RUNNING").values() if j.min_replicas and len(j.allocations) < j.replicas]
