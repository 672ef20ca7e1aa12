"""The cycle's side of the one decision (phalanx.core.decide): the snapshot from the view, and the plan applied.

`snapshot_of` reads the in-memory view (the ledger as this cycle loaded it) into a `decide.Snapshot`; the only
ledger reads are the victims' outstanding checkpoint requests (only while a preemption is under way) and, lazily,
the running gangs' last committed checkpoints (only when a preemption search runs). `apply_plan` writes the plan in
the cycle's transaction, step by step, with the writes the cycle has always made (`reserve`, `teardown`, `set_job`,
checkpoint requests), and queues the agents' assignments; `finish_cycle` flushes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import structlog

from phalanx.core.backfill import RunningEnd, RunningSet
from phalanx.core.decide import (
    AskCheckpoint,
    CallOff,
    DecideConfig,
    EndClaim,
    Memo,
    PendingJob,
    Plan,
    Reserve,
    RunningJob,
    SetClaim,
    Snapshot,
    Stop,
    Wait,
    WakeAt,
)
from phalanx.core.model import GangRequest, Placement, ReplicaPlacement
from phalanx.core.placement import domain_members
from phalanx.core.quota import cluster_totals

from . import jobgraph, ledger, lifecycle
from .elastic import elastic_below_max
from .state import JobRecord, SchedulerState
from .transitions import Cycle, refused, reserve, set_job, teardown

log = structlog.get_logger()


class _Lazy(Mapping):
    """A mapping built on first use (the running gangs, their last commits): a cycle that needs neither pays
    nothing for them."""

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self._build: Callable[[], dict[str, Any]] = build
        self._data: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._data is None:
            self._data = self._build()
        return self._data

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self) -> Iterator:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def pending_job(job: JobRecord, state: SchedulerState | None = None, tiers: tuple[str, ...] = ()) -> PendingJob:
    """The job as the decision's pending queue holds it (built by JobTable.pending_view only for the jobs that
    entered the queue or changed since the last cycle). A service's replica carries its soft preferences (the
    domain it ran in before, its siblings' domains) and, while it is a rolling update's surge, that it never
    preempts."""
    request = job.request()
    if job.service and state is not None:
        request = serving_preferences(job, request, state, tiers)
    elif job.min_replicas and job.allocations:  # an elastic gang goes back to the nodes it still has (a shrink)
        request = replace(request, prefer=frozenset(job.nodes))
    # A job held by its dependencies, or an array's parent row, is never placed (jobgraph.not_before)
    start = jobgraph.not_before(job) if job.after or job.array else job.not_before
    return PendingJob(request, job.queue, start, job.by_admin, preempts=not job.serving.get("surge"))


def serving_preferences(
    job: JobRecord, request: GangRequest, state: SchedulerState, tiers: tuple[str, ...]
) -> GangRequest:
    """A replica goes back to the domain (of the fabric's lowest tier) it ran in before when it fits there, and
    keeps off the domains of `spread_tier` its running siblings occupy when it fits elsewhere."""
    spread_tier = str(job.serving.get("spread_tier") or "")
    prefer: frozenset[str] = frozenset()
    if job.allocations:  # its last attempt's nodes
        prefer = domain_members(state.capacity, job.nodes, tiers[0] if tiers else "node", tiers)
    spread: frozenset[str] = frozenset()
    if spread_tier:
        siblings = [
            node
            for other in state.jobs.in_state("RUNNING").values()
            if other.service == job.service and other.id != job.id
            for node in other.nodes
        ]
        spread = domain_members(state.capacity, siblings, spread_tier, tiers)
        prefer = prefer - spread
    return replace(
        request,
        prefer=prefer,
        spread=spread,
        spread_group=job.service if spread_tier else "",
        spread_tier=spread_tier,
    )


def running_job(job: JobRecord) -> RunningJob:
    key = (
        job.version,
        job.attempt,
        job.started_at,
        job.running_at,
        job.flavor,
        job.preempted_by,
        job.preempt_deadline,
        len(job.allocations) + len(job.spares),
    )
    cached = job.snapshot_cache.get("running")
    if cached is not None and cached[0] == key:
        return cached[1]
    entry = _running_job(job)
    job.snapshot_cache["running"] = (key, entry)
    return entry


def _running_job(job: JobRecord) -> RunningJob:
    return RunningJob(
        job.request(),
        Placement(job.id, tuple(job.replica_placements()), "", 0, 0.0, ""),
        job.started_at,
        job.queue,
        job.flavor,
        job.attempt,
        job.running_at or job.started_at,
        job.gpu_equivalents,
        job.preempted_by,
        job.preempt_deadline,
        True,
    )


def quota_totals(state: SchedulerState) -> dict[str, float]:
    """The quotas' denominators: the cluster's GPUs per flavor, MIG slices counted only on GPUs in MIG mode."""
    return cluster_totals(
        (n.gpu_model, n.memory_mib, g in n.mig_gpus) for n in state.nodes.values() for g in range(n.gpus)
    )


def running_ends(state: SchedulerState) -> RunningSet:
    """The running gangs in end order (backfill's input when the head is blocked), brought up to date with the
    running jobs: only the gangs that started, stopped or changed attempt since the last cycle move in it, and its
    version tells the reservation memo whether anything did."""
    ends, built = state.ends, state.ends_built
    running = state.jobs.in_state("RUNNING")
    if len(built) > len(running) or any(j not in running for j in built):
        for job_id in [j for j in built if j not in running]:
            ends.discard(job_id)
            del built[job_id]
    for job in running.values():
        key = (job.attempt, job.started_at, job.time_limit, len(job.allocations) + len(job.spares))
        if built.get(job.id) != key:
            gang = running_job(job)
            ends.add(RunningEnd(job.id, gang.placement, gang.ends_at))
            built[job.id] = key
    return ends


def snapshot_of(cycle: Cycle, pending: list[PendingJob] | None = None) -> Snapshot:
    """This cycle's view as the decision's input. `pending`: instead of the whole pending queue (the admission lane
    decides its arrivals alone)."""
    state, s = cycle.state, cycle.settings
    jobs = state.jobs
    victims = [j for j in jobs.in_state("RUNNING").values() if j.preempted_by]  # JobRecord.preempting, inline
    waiting = cycle.work.read(ledger.outstanding_requests, [v.id for v in victims]) if victims else set()

    def running() -> dict[str, RunningJob]:
        out = {}
        for j in jobs.in_state("RUNNING").values():
            r = running_job(j)
            if j.preempted_by and j.id not in waiting:
                r = RunningJob(
                    r.request,
                    r.placement,
                    r.started_at,
                    r.queue,
                    r.flavor,
                    r.attempt,
                    r.progress_since,
                    r.gpus,
                    r.preempted_by,
                    r.deadline,
                    False,
                )
            out[j.id] = r
        return out

    def saved_at() -> dict[str, float]:
        ids = list(jobs.in_state("RUNNING"))
        commits = cycle.work.read(ledger.latest_commits, ids)
        return {i: c[2] for i, c in commits.items() if i in jobs and c[1] == jobs[i].attempt}

    totals = quota_totals(state) if state.queues else {}
    config = DecideConfig(
        tiers=s.fabric.tiers,
        backfill=s.backfill,
        preemption=s.preemption,
        poll_s=s.preemption_poll_s,
        placement_budget_ms=s.placement_budget_ms,
        depth=s.backfill_depth or None,
        backfill_budget_ms=s.backfill_budget_ms,
        claims=s.claims,
        elastic=s.elastic,
    )
    return Snapshot(
        capacity=state.capacity,
        pending=jobs.pending_view(lambda job: pending_job(job, state, s.fabric.tiers)) if pending is None else pending,
        running=_Lazy(running),
        config=config,
        unusable=unusable(state),
        queues=state.queues,
        totals=totals,
        saved_at=_Lazy(saved_at),
        preempting=[v.id for v in victims],
        memo=Memo(state.reservation_memo, state.no_preemption),
        ends=lambda: running_ends(state),
        hold_on_stop=frozenset(n.name for n in state.nodes.values() if n.confirms_release),
        releasing=releasing(state),
        claims=state.claims,
        elastic=elastic_below_max(state),
    )


def releasing(state: SchedulerState) -> list[Placement]:
    """The whole GPUs held for ended attempts until their agents say the processes are gone, as placements."""
    return [
        Placement(key, (ReplicaPlacement(0, n.name, gpus),), "", 0, 0.0, "releasing")
        for n in state.nodes.values()
        if n.releasing
        for key, gpus in n.releasing.items()
    ]


def unusable(state: SchedulerState) -> dict[str, set[int]]:
    """GPUs out of placement besides what runs: FATAL ones and those switching MIG mode."""
    # Only a node with a GPU health report or a MIG switch can hold any: the others cost an attribute test.
    return {n.name: held for n in state.nodes.values() if (n.gpu_health or n.mig_switches) and (held := n.held_gpus)}


def apply_plan(cycle: Cycle, plan: Plan) -> None:
    """Write the plan in this cycle's transaction, in order. The job writes are compare-and-set: one another writer
    changed fails the whole cycle, which reruns on a reloaded view (ledger.update_job)."""
    state = cycle.state
    for step in plan:
        if isinstance(step, Reserve):
            placed = state.jobs[step.job]
            placed.flavor = step.flavor
            reserve(cycle, placed, step.placement)
            if step.ahead_of:
                log.info("backfilled", job=placed.id, ahead_of=step.ahead_of)
        elif isinstance(step, AskCheckpoint):
            victim = state.jobs.get(step.job)
            if victim is None:
                continue
            set_job(cycle, victim, preempted_by=step.by, preempt_deadline=step.deadline, message=step.message)
            cycle.work.write(ledger.request_checkpoint, victim.id, step.request, cycle.now)
            cycle.touched(victim)
            log.info("preemption_started", preemptor=step.by, victim=victim.id, deadline=step.deadline)
        elif isinstance(step, Stop):
            victim = state.jobs.get(step.job)
            if victim is None:
                cycle.resync_after = True  # the index already gave its GPUs back
                continue
            if not lifecycle.allowed(victim.state, "preempt"):  # only a running gang is stopped: nothing changes
                refused(victim, "preempt")
                continue
            if step.by:
                cycle.work.later(ledger.mark_attempt_preempted, victim.id, victim.attempt, step.by)
                cycle.metrics.preempted.append((victim.id, step.by))
            cause = "RESIZED" if step.resize else "PREEMPTED"
            teardown(cycle, victim, cause=cause, message=step.reason, released=True)
            cycle.handover = True
        elif isinstance(step, SetClaim):
            cycle.work.claim(ledger.set_claim, step.claim, cycle.now)
            state.claims[step.claim.job] = step.claim
            claimant = state.jobs.get(step.claim.job)
            if claimant is not None:
                cycle.touched(claimant)
            log.info(
                "claim_made",
                job=step.claim.job,
                gpus=step.claim.gpus,
                nodes=list(step.claim.nodes),
                victims=list(step.claim.victims),
            )
        elif isinstance(step, EndClaim):
            claim = state.claims.pop(step.job, None)
            cycle.work.claim(ledger.end_claim, step.job, step.reason, cycle.now)
            if claim is not None and step.reason == "it runs":
                cycle.metrics.claims_run.append((step.job, len(claim.victims)))
            claimant = state.jobs.get(step.job)
            if claimant is not None:
                cycle.touched(claimant)
            log.info("claim_ended", job=step.job, reason=step.reason)
        elif isinstance(step, CallOff):
            victim = state.jobs.get(step.job)
            if victim is not None:  # (a grow called off keeps its deadline: its last try, phalanx.core.elastic)
                kept = victim.preempt_deadline if victim.preempted_by == victim.id else 0.0
                set_job(cycle, victim, preempted_by="", preempt_deadline=kept, message=step.reason)
                cycle.touched(victim)
        elif isinstance(step, Wait):
            job = state.jobs.get(step.job)
            if job is not None and job.message != step.status.reason:
                set_job(cycle, job, message=step.status.reason)
                cycle.touched(job)
        elif isinstance(step, WakeAt) and step.t < math.inf:
            cycle.wake_at(step.t)
