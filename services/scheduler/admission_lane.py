"""The admission lane (issue 35 item 1): a batch of submits decided at once, on the arrivals alone.

When the writer takes a batch of nothing but submits, and the view is settled (phalanx.core.admit: no pass owed,
no timer due, no claim or preemption under way), the cycle does not run the pass over the whole pending queue.
It decides the arrivals that are strictly ahead of every other pending job, with the same decision core and on the
same capacity, preemption and backfill off, and writes their reservations in the same transaction as the jobs,
under the same lock and fencing epoch as any cycle (service._transaction_on). The reply carries the placement and
the agents get their launches at the commit, as after a pass.

Everything else is left to the pass, which the lane marks as owed: an arrival that is not ahead of the queue (so a
submit never jumps a blocked head of its own priority), one that does not fit now or that its quota refuses, a job
graph's dependent or array, and a service's replica.
"""

from __future__ import annotations

import time

import structlog

from phalanx.core.admit import ahead_of_queue, arrivals_snapshot, unsettled
from phalanx.core.decide import decide
from phalanx.core.plan import Plan, Reserve

from .planning import apply_plan, pending_job, snapshot_of
from .spares import rebook_spares
from .state import JobRecord
from .transitions import Cycle

log = structlog.get_logger()


def lane_job(job: JobRecord) -> bool:
    """A job the lane may decide: not a job graph's (its dependencies and array tasks are the pass's, jobgraph.py),
    nor a service's replica (the serving controller's)."""
    return not (job.after or job.array or job.array_parent or job.service)


def admit(cycle: Cycle, arrivals: list[JobRecord], *, settled_before: bool, timers_due: bool) -> str:
    """Decide `arrivals` (this cycle's new jobs, in the view as PENDING) alone when the view allows it. Returns ""
    when the lane decided them (those it did not reserve are left to the next pass, marked as owed), else why not:
    the caller then runs the pass as usual, and nothing was changed here."""
    state = cycle.state
    cycle.work.apply()  # the submits' own reads and writes, so that what changed counts
    changes = cycle.work.changes
    why = unsettled(
        pass_due=not settled_before or (changes is not None and changes.sched),
        now=cycle.now,
        wake_at=state.wake_at,
        claims=len(state.claims),
        preempting=sum(1 for j in state.jobs.in_state("RUNNING").values() if j.preempted_by),
        timers_due=timers_due,
    )
    if why:
        return why
    candidates = [j for j in arrivals if j.state == "PENDING" and lane_job(j)]
    others = state.jobs.pending_priorities()
    others.subtract(j.priority for j in candidates)
    tiers = cycle.settings.fabric.tiers
    ahead = ahead_of_queue([pending_job(j, state, tiers) for j in candidates], (p for p, n in others.items() if n))
    if not ahead:
        return "no arrival is ahead of the pending queue"
    t0 = time.perf_counter()
    rebook_spares(cycle)  # as the pass does first: a gang's missing spares take the domain's free GPUs before arrivals
    snapshot = arrivals_snapshot(snapshot_of(cycle, pending=[]), ahead)
    plan = decide(snapshot, cycle.now)
    t1 = time.perf_counter()
    apply_plan(cycle, Plan(tuple(plan.of(Reserve))))  # a blocked arrival's Wait is the pass's to say
    left = [j for j in arrivals if j.state == "PENDING"]
    state.pass_due = bool(left)  # settled before: only what the lane left undecided is owed to the pass
    for job in arrivals:
        if job.state == "RUNNING" and job.time_limit:
            cycle.wake_at(job.started_at + job.time_limit)  # fire_timers stops it there, as after a pass
    cycle.metrics.admitted_at_submit += len(arrivals) - len(left)
    cycle.metrics.timings.update(
        lane_decide_ms=round((t1 - t0) * 1000, 1), lane_apply_ms=round((time.perf_counter() - t1) * 1000, 1)
    )
    return ""
