"""Elastic gangs in the decision (GangRequest.min_replicas): growing a running gang towards its maximum.

Starting and shrinking need nothing here. Placement gives an elastic gang the most replicas that fit, between its
minimum and maximum (placement.elastic), whenever it is placed: when it first starts, and when it is placed again
after a node of it was lost (the scheduler requeues it at once, preferring the nodes it still has: a shrink).

Growing is a restart at the bigger size through the checkpoint handshake the preemption path uses, with the gang as
its own "preemptor" (`RunningJob.preempted_by` is its own id):
1. `plan_grows`, after the pass: a running elastic gang below its maximum, whose attempt started at least
   `ElasticPolicy.grow_interval_s` ago, with no gang of equal or higher priority waiting (what frees is theirs
   first), that would fit at least `grow_target` replicas with its own GPUs given back (preferring its own nodes'
   domain), is asked to checkpoint (`AskCheckpoint`, `by` itself) by the end of `ElasticPolicy.grace_period_s`.
2. `finish_grow`, from `stop_victims`: once that checkpoint is committed (or the grace period is over) and the
   bigger size still fits with nothing of equal or higher priority waiting, the gang is stopped (`Stop`, `resize`)
   and requeued in this very decision, where the pass places it again, at the most replicas that fit then (at
   least its current size: its own GPUs are free again). Otherwise the grow is called off (`CallOff`) and it keeps
   running as it is.
Thrash is bounded: at most one grow per `grow_interval_s` per gang, each by at least `min_step` replicas or
`min_fraction` of its size (or up to its maximum).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from .capacity import ClusterCapacity
from .elastic_units import noun, round_up, running_size, shown, split_at_minimum
from .model import GangRequest, Placement, ReplicaPlacement
from .placement import domain_members, place_gang
from .plan import AskCheckpoint, CallOff, Step, Stop
from .snapshot import DecideConfig, ElasticPolicy, PendingJob, RunningJob, Snapshot


class _Decision(Protocol):
    """What this module uses of a decision's working view (decide._Decision; named here, not imported: decide
    imports this module)."""

    snap: Snapshot
    config: DecideConfig
    cap: ClusterCapacity
    now: float
    removed: set[str]
    preempting: set[str]
    pending: dict[str, PendingJob]
    steps: list[Step]
    handover_to: set[str]
    releasing: list[Placement]

    def get(self, job_id: str) -> RunningJob: ...
    def running(self) -> Iterator[tuple[str, RunningJob]]: ...
    def wake_at(self, t: float) -> None: ...
    def ready(self) -> list[PendingJob]: ...
    def serve(
        self, pending: Sequence[PendingJob], *, backfill: bool, memo: dict[str, Any] | None, depth: int | None
    ) -> Any: ...
    def _set_running(self, job: RunningJob) -> None: ...
    def _release(self, job: RunningJob) -> None: ...


def size(job: RunningJob) -> int:
    """The replicas its attempt runs with, in its request's units (a segmented gang's segments whole, with their
    spares: elastic_units)."""
    return running_size(job.request, job.placement.replicas)


def grow_target(job: RunningJob, policy: ElasticPolicy) -> int:
    """The smallest size worth a restart (whole segments for a segmented gang)."""
    now = size(job)
    return round_up(job.request, now + max(policy.min_step, math.ceil(now * policy.min_fraction), 1))


def resizing(job: RunningJob) -> bool:
    """It was asked to checkpoint for its own grow (not a preemption)."""
    return bool(job.preempted_by) and job.preempted_by == job.job_id


def plan_grows(d: _Decision) -> None:
    """Ask every running elastic gang that may grow now to checkpoint for it (step 1 of the module docstring)."""
    policy = d.config.elastic
    if policy is None:
        return
    ids = d.snap.elastic
    candidates = [d.get(j) for j in ids if j not in d.removed] if ids is not None else [r for _, r in d.running()]
    candidates = [r for r in candidates if r.request.elastic and size(r) < r.request.replicas]
    if not candidates:
        return
    top = _waiting_priority(d, "")
    free = d.cap.free_gpus()  # (a cheap bound first: a grow needs at least its step's GPUs free)
    for job in candidates:
        if job.job_id in d.preempting or job.request.priority <= top:
            continue
        # From the attempt's start, or from its last grow called off (its deadline is kept: RunningJob.deadline).
        due = max(job.started_at, job.deadline) + policy.grow_interval_s
        if d.now < due:
            d.wake_at(due)
            continue
        target = grow_target(job, policy)
        if free < (target - size(job)) * job.request.gpus_per_replica:
            continue
        got = bigger(d, job, target)
        if got is not None:
            _ask(d, job, len(got.replicas), policy)


def finish_grow(d: _Decision, job: RunningJob) -> bool:
    """A gang asked to checkpoint for its grow: stop and requeue it once it may, or call the grow off. True when it
    was stopped (step 2 of the module docstring)."""
    vid, now, r = job.job_id, d.now, job.request
    if job.checkpoint_pending and now < job.deadline:
        d.wake_at(min(job.deadline, now + d.config.poll_s))  # its commit clears the request unannounced: look again
        return False
    policy = d.config.elastic or ElasticPolicy()
    got, why = None, "its checkpoint was not committed within its grace period (a grow never loses work)"
    if not job.checkpoint_pending:
        why = "a gang of equal or higher priority waits for the capacity"
        if job.request.priority > _waiting_priority(d, vid):
            why = "the capacity it would take is no longer free"
            got = bigger(d, job, grow_target(job, policy))
    if got is None:
        # The deadline stays, as when it last tried: the next grow waits a whole interval from it (plan_grows).
        d._set_running(replace(job, preempted_by="", checkpoint_pending=True))
        d.preempting.discard(vid)
        d.steps.append(
            CallOff(
                vid,
                f"running at {shown(r, size(job))} of at most {shown(r, r.replicas)} {noun(r)}; the grow was called "
                f"off: {why}",
            )
        )
        return False
    d._release(job)
    d.pending[vid] = PendingJob(_preferring(d, job.request, job.placement), job.queue)  # placed in this very pass
    d.steps.append(
        Stop(
            vid,
            f"elastic grow from {shown(r, size(job))} towards {shown(r, len(got.replicas))} {noun(r)}: its checkpoint "
            "is committed; it restarts at the new size from it",
            resize=True,
        )
    )
    d.handover_to.add(vid)
    return True


def restarting(d: _Decision) -> set[str]:
    """The pending elastic gangs whose last attempt's GPUs are still being released on nodes in service (their
    nodes confirm that its processes are gone: the clean handover). Such a gang, stopped to grow or shrunk after a
    loss, waits for them rather than restart on what happens to be free first, smaller, and grow back later (a
    thrash); the releases come within moments, and each is a change the scheduler decides on."""
    out: set[str] = set()
    for held in d.releasing:
        job_id = held.job_id.split("/", 1)[0]
        pending = d.pending.get(job_id)
        if pending is None or not pending.request.elastic or job_id in out:
            continue
        for rep in held.replicas:
            node = d.cap.nodes.get(rep.node)
            if node is not None and node.schedulable:
                out.add(job_id)
                break
    return out


def kept_back(victim: RunningJob, shrunk: bool) -> tuple[ReplicaPlacement, ...]:
    """What a preemption frees of a victim: all of it, or, when it only shrinks an elastic gang to its minimum
    (preemption.elastic_parts), the replicas beyond its minimum (whole segments, with their spares)."""
    reps = victim.placement.replicas
    return split_at_minimum(victim.request, reps)[1] if shrunk else reps


def bigger(d: _Decision, job: RunningJob, target: int) -> Placement | None:
    """Where the gang would run with at least `target` replicas, its own GPUs given back (its unusable GPUs stay
    out); None if it would not. Leaves the capacity as it found it."""
    cap, unusable = d.cap, d.snap.unusable
    cap.release_placement(job.placement)
    hidden: list[tuple[str, set[int]]] = []
    for node in job.placement.nodes:
        held = unusable.get(node)
        if held and node in cap.nodes:
            back = set(held) & cap.nodes[node].free
            cap.take(node, back)
            hidden.append((node, back))
    try:
        request = replace(_preferring(d, job.request, job.placement), min_replicas=target)
        got = place_gang(cap, request, d.config.tiers)
    finally:
        for node, back in hidden:
            cap.release(node, back)
        cap.reserve(job.placement)
    return got if isinstance(got, Placement) and len(got.replicas) >= target else None


def _preferring(d: _Decision, request: GangRequest, placement: Placement) -> GangRequest:
    """The request preferring its nodes' domain (of the fabric's lowest tier), where it fits there."""
    tiers = d.config.tiers
    near = domain_members(d.cap, placement.nodes, tiers[0] if tiers else "node", tiers)
    return replace(request, prefer=near | frozenset(placement.nodes))


def _waiting_priority(d: _Decision, besides: str) -> float:
    """The highest priority among the gangs that wait now (in no backoff, not placed in this decision), `besides`
    excepted; -inf when none."""
    return max(
        (p.request.priority for p in d.ready() if p.job_id != besides),
        default=-math.inf,
    )


def _ask(d: _Decision, job: RunningJob, to: int, policy: ElasticPolicy) -> None:
    deadline = d.now + policy.grace_period_s
    jid, r = job.job_id, job.request
    d.steps.append(
        AskCheckpoint(
            jid,
            deadline,
            jid,
            f"elastic grow: from {shown(r, size(job))} to {shown(r, to)} {noun(r)}",
            f"growing from {shown(r, size(job))} to {shown(r, to)} of at most {shown(r, r.replicas)} {noun(r)}: asked "
            "to checkpoint; it restarts at the new size once that is committed (by the end of its grace period at the "
            "latest)",
        )
    )
    d._set_running(replace(job, preempted_by=jid, deadline=deadline, checkpoint_pending=True))
    d.preempting.add(jid)
    d.wake_at(min(deadline, d.now + d.config.poll_s))
    if policy.grace_period_s <= 0 and finish_grow(d, d.get(jid)):  # no handshake: restarted at once, here
        again = [p for p in d.ready() if p.job_id == jid]  # (unless it waits for its own GPUs' release)
        if again:
            d.serve(again, backfill=False, memo=None, depth=None)
