"""One scheduling cycle: apply a batch of commands, fire timers, place pending gangs, all in one transaction.

The cycle runs in the scheduler's single writer thread. Commands validate before they write, so a rejected
command changes nothing; the in-memory view is updated as the unit of work (work.py) queues the ledger's writes,
and if the transaction does not commit the service reloads the view from the ledger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from phalanx.core.backfill import BackfillResult
from phalanx.core.decide import AfterBlocked, decide

from . import jobgraph, ledger
from .admission_lane import admit
from .commands import Register, Submit, register_all, submit_all, write_new_jobs
from .convert import job_from_record
from .elastic import elastic_below_max
from .pools import book_pools
from .spares import drop_spares_on, rebook_spares, swap_or_teardown
from .state import JobRecord
from .transitions import (
    Command,
    Cycle,
    CycleCommand,
    teardown,
)

log = structlog.get_logger()


def fire_timers(cycle: Cycle) -> None:
    s, now = cycle.settings, cycle.now
    for node in list(cycle.state.nodes.values()):
        if node.state in ("READY", "DRAINED") and now - node.last_heartbeat > s.lease_timeout:
            threshold = now - s.lease_timeout
            msg = f"no heartbeat for {now - node.last_heartbeat:.0f}s (lease {s.lease_timeout:.0f}s)"
            if not cycle.work.ask(ledger.set_node_state, node.id, "LOST", msg, only_if_heartbeat_before=threshold):
                cycle.resync_after = True  # another replica heard from it more recently
                continue
            node.state = "LOST"
            cycle.state.set_node_schedulable(node.name)
            log.warning("node_lost", node=node.name, reason=msg)
            cycle.work.write(
                ledger.add_node_events,
                node.id,
                [dict(at=now, gpu=-1, severity="FATAL", kind="LOST", code=0, reason=msg)],
            )
            for job in cycle.state.running_on(node.name):  # a spare of the domain takes its place, if any
                swap_or_teardown(cycle, job, node.name, cause="NODE_LOST", message=f"node {node.name} was lost ({msg})")
            drop_spares_on(cycle, node.name)
    for job in cycle.state.running():  # time limits and launch deadlines apply to running gangs only
        if job.state == "RUNNING" and job.time_limit and now >= job.started_at + job.time_limit:
            teardown(
                cycle,
                job,
                final_state="FAILED",
                cause="TIMEOUT",
                message=f"stopped at its time limit of {job.time_limit:g}s",
            )
            continue
        if job.state == "RUNNING" and job.launch_deadline is not None and now > job.launch_deadline:
            waiting = sorted(r.rank for r in job.ranks.values() if r.state == "ASSIGNED")
            teardown(
                cycle,
                job,
                cause="LAUNCH_TIMEOUT",
                message=f"ranks {waiting[:8]} did not start within {s.launch_timeout:.0f}s",
            )


def schedule(cycle: Cycle) -> None:
    """The scheduling pass: snapshot the view, decide (phalanx.core.decide: stop the victims whose time is up, place
    pending gangs in order, preempt for a blocked head), apply the plan in this transaction. Victims stopped here
    free their GPUs in it, so the gang they make way for is reserved in the same commit (an atomic handover)."""
    from .planning import apply_plan, snapshot_of

    state = cycle.state
    rebook_spares(cycle)  # missing spares first: the domain's free GPUs go to them before pending gangs
    cycle.work.apply()  # the commands' and timers' writes, so that what they changed counts (changes.sched)
    changes = cycle.work.changes
    if not (state.pass_due or (changes is not None and changes.sched) or cycle.now >= state.wake_at):
        return  # nothing the pass decides on changed since the last one: it would decide the same
    state.pass_due = False
    state.wake_at = math.inf
    book_pools(cycle)  # the spare pools' idle nodes, booked again where missing, before pending gangs are placed
    jobgraph.advance(cycle)  # dependencies resolved, arrays' next tasks created, before the decision
    # With nothing waiting and no victim, there is nothing to decide (nor a capacity index to build: a registration
    # storm on an idle cluster builds it once, when the first gang arrives).
    if (
        state.jobs.in_state("PENDING")
        or state.claims
        or any(j.preempted_by for j in state.jobs.in_state("RUNNING").values())
        or (cycle.settings.elastic is not None and elastic_below_max(state))
    ):
        t0 = time.perf_counter()
        snapshot = snapshot_of(cycle)
        t1 = time.perf_counter()
        plan = decide(snapshot, cycle.now, after_blocked=mig_hook(cycle))
        t2 = time.perf_counter()
        state.no_preemption = snapshot.memo.no_preemption
        apply_plan(cycle, plan)
        cycle.metrics.timings.update(
            snapshot_ms=_ms(t1 - t0), decide_ms=_ms(t2 - t1), apply_ms=_ms(time.perf_counter() - t2)
        )
    for job in state.jobs.in_state("RUNNING").values():  # after the plan: the gangs it reserved have limits too
        if job.time_limit:
            cycle.wake_at(job.started_at + job.time_limit)  # fire_timers stops it there


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def mig_hook(cycle: Cycle) -> AfterBlocked | None:
    """--mig-manage: a head blocked only by the GPUs' MIG modes waits for switches rather than preempting."""
    if not any(n.mig_manage for n in cycle.state.nodes.values()):
        return None
    from .migmode import after_pass

    def hook(head: str, result: BackfillResult, pending: Sequence[str], backfill: bool) -> tuple[str | None, str]:
        jobs = cycle.state.jobs
        return after_pass(cycle, jobs[head], result, [jobs[j] for j in pending if j in jobs], backfill)

    return hook


def run_cycle(
    cycle: Cycle,
    commands: list[Command],
    *,
    timers_due: bool = True,
    schedules: bool = True,
    admission: bool = False,
    timers_pending: Callable[[], bool] = lambda: True,
) -> list[Any]:
    """Execute commands in order (submits in bulk), fire timers, schedule. Returns one result or error each.

    `schedules` False (a replica that does not lead): the commands only; timers and placement are the leader's.
    `admission` (a batch of nothing but submits, on a view no other writer changed): the admission lane decides
    the arrivals alone when the view is settled (admission_lane.py), and the pass runs only for what it left;
    `timers_pending()` says whether a timer is due (asked only then)."""
    t0 = time.perf_counter()
    settled_before = not cycle.state.pass_due  # the submits set it: the lane asks whether it was owed before them
    results: list[Any] = [None] * len(commands)
    submits = [(i, c) for i, c in enumerate(commands) if isinstance(c, Submit)]
    if submits:
        for (i, _), value in zip(submits, submit_all(cycle, [c for _, c in submits]).values(), strict=True):
            results[i] = value
    from services.common.errors import ServiceError

    registers = [(i, c) for i, c in enumerate(commands) if isinstance(c, Register)]
    if len(registers) > 1:
        for (i, _), value in zip(registers, register_all(cycle, [c for _, c in registers]).values(), strict=True):
            results[i] = value
    batched = len(registers) > 1
    for i, command in enumerate(commands):
        if isinstance(command, Submit) or (batched and isinstance(command, Register)):
            continue  # taken together above (submit_all, register_all)
        if not isinstance(command, CycleCommand):
            raise TypeError(f"{type(command).__name__} is neither a submission nor a command the cycle executes")
        try:
            results[i] = command.execute(cycle)
        except ServiceError as exc:
            results[i] = exc
    t1 = time.perf_counter()
    cycle.metrics.timings["commands_ms"] = _ms(t1 - t0)
    if not schedules:
        return results
    if admission and submits:
        arrivals = list(cycle.work.new_jobs)
        why = admit(cycle, arrivals, settled_before=settled_before, timers_due=timers_due and timers_pending())
        cycle.metrics.lane_skipped, cycle.metrics.admission_path = why, ("pass" if why else "lane")
        if not why:
            if cycle.state.pass_due:
                schedule(cycle)  # what the lane left (an arrival not ahead of the queue, or that did not fit)
            return results
    if timers_due:
        fire_timers(cycle)
        cycle.metrics.timings["timers_ms"] = _ms(time.perf_counter() - t1)
    schedule(cycle)
    return results


def finish_cycle(cycle: Cycle, commands: list[Command], results: list[Any]) -> None:
    """The closing writes. They need no answers, so the caller sends them (and the commit) pipelined."""
    write_new_jobs(cycle)
    work = cycle.work
    work.write_claims()
    cycle.flush()
    work.flush_ranks()
    work.write(ledger.persist_heartbeats, work.heartbeats)
    work.write(ledger.persist_acks, work.acks)
    work.apply()  # what the writes changed decides whether the generation moves
    changes = work.changes
    if commands or cycle.changed or cycle.woken_nodes or work.heartbeats or (changes is not None and changes.any):
        work.generation = work.ask(ledger.bump_generation, work.generation, notice(cycle))
        if changes is not None:
            work.write(ledger.record_changes, work.generation, cycle.settings.replica_id, changes, cycle.now)
    work.apply()  # the closing writes, before the caller's commit
    for i, value in enumerate(results):
        if isinstance(value, JobRecord):
            results[i] = job_from_record(value)
        elif isinstance(value, tuple) and value and isinstance(value[0], JobRecord):
            results[i] = (job_from_record(value[0]), *value[1:])


def notice(cycle: Cycle) -> dict[str, Any]:
    """What other replicas need to hear about this cycle: whose streams and watchers to wake."""
    return {"replica": cycle.settings.replica_id, "nodes": sorted(cycle.woken_nodes), "jobs": sorted(cycle.changed)}
