"""MIG mode switches on agents started with --mig-manage: the scheduler's side.

Such an agent registers so (RegisterNodeRequest.mig_manage, nodes.mig_manage): the scheduler may then switch an idle
GPU's MIG mode when its queue needs it. Everywhere else a GPU's mode is the administrator's.

Deciding (`after_pass`, called by the scheduling pass when the head of the queue is blocked): when the head, or with
backfill a gang behind it (in serving order), cannot be placed only because of the GPUs' modes (a `--mig` gang and
no GPU in MIG mode has room; a whole-GPU or share gang and idle GPUs in MIG mode are in the way), the fewest
candidate GPUs that make it fit (phalanx.core.mig_switch.plan_switches) are asked to switch: a SetMigMode
assignment on the node's assignment stream, under the node's next revision like launches and kills. Candidates are
idle GPUs (no allocation, no MIG instance, none the agent did not make), healthy, not switching, of a MIG-capable
family (with the requested profile), on READY, schedulable nodes of --mig-manage agents, whose mode changed at least
--mig-switch-hold seconds ago (no flapping) and whose last switch did not fail in the last --mig-switch-backoff
seconds. Only one gang's switches are asked per cycle; switches under way count as done (a gang asks only for
what they do not cover), and a gang that switches can make fit waits for them instead of preempting.

While a switch is under way its GPU is out of placement for every request (SchedulerState.rebuild_capacity holds
it), and the gang that waits for it says so: "waiting for GPU 3 of node-b to switch to MIG mode (asked 2 s ago)".

Ending (`MigModeReport`, queued by SchedulerService.heartbeat from HeartbeatRequest.mig_modes): a changed current
mode updates the GPU's ledger row and the capacity view (as a registration with another mode does, without a new
agent) and ends the switch; an error ends it as failed: logged, a node event, and that GPU is not asked again for
--mig-switch-backoff seconds. The errors and "no switch under way" of a heartbeat count only once the agent had
acknowledged the SetMigMode before its previous heartbeat (a heartbeat built before the agent took the assignment
still shows the last switch's state). A mode the agent reports pending (NVML needs a GPU reset to apply it, e.g.
in a VM) is shown (`mig_mode_pending`); the switch ends when a reset applied it.

The switch state is in the ledger (gpus.mig_switch_*, mig_switched_at, mig_mode_pending), so another replica, or
this one after a restart, carries on where it was.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core import mig
from phalanx.core.mig_switch import SwitchPlan, plan_switches, wants_mig_mode
from phalanx.core.model import Placement

from . import ledger
from .state import JobRecord, MigSwitch, NodeRecord, SchedulerState
from .transitions import Cycle, CycleCommand, set_job

log = structlog.get_logger()

Gpu = tuple[str, int]
MAX_BEHIND = 8  # gangs behind a blocked head whose switches are looked at in one cycle
PLAN_TTL_S = 5.0  # a plan is worked out again at least this often while nothing it depends on changes
WAITING = "waiting for GPU"  # how a gang's message starts while it waits for MIG mode switches
DEFERRED = "(deferred)"  # _serve: the gang needs switches that another gang's, asked first in this cycle, delay
_MODES = {1: "DISABLED", 2: "ENABLED"}  # phalanx.v1.GpuInfo.MigMode; UNSUPPORTED (0): not known


class MigStatus(NamedTuple):
    """One GPU of a heartbeat's mig_modes: modes as "ENABLED" / "DISABLED" ("" unknown)."""

    current: str
    pending: str
    switching: bool
    error: str


def statuses_from_proto(mig_modes: Iterable[Any]) -> dict[int, MigStatus]:
    return {
        int(m.gpu): MigStatus(
            _MODES.get(m.current, ""), _MODES.get(m.pending, ""), bool(m.switching), m.error.replace("\x00", "")[:2000]
        )
        for m in mig_modes
    }


class Change(NamedTuple):
    """What a heartbeat changes for one GPU. `kind`: "mode" (value: True in MIG mode now), "pending" (value: the
    mode a GPU reset will apply, None when none), "done" (a switch whose target the view already has), "failed"
    (value: why)."""

    kind: str
    gpu: int
    value: Any = None


def _mode(enable: bool) -> str:
    return "ENABLED" if enable else "DISABLED"


def report_changes(node: NodeRecord, statuses: dict[int, MigStatus], acked: int) -> list[Change]:
    """What the agent's MIG mode report changes in the view of `node` (nothing: an empty list). `acked`: the
    assignment revision the agent had acknowledged before its previous heartbeat (see the module docstring)."""
    out: list[Change] = []
    moved: set[int] = set()
    for gpu, st in sorted(statuses.items()):
        if not 0 <= gpu < node.gpus or not st.current:
            continue
        enabled = st.current == "ENABLED"
        if enabled != (gpu in node.mig_gpus):
            out.append(Change("mode", gpu, enabled))
            moved.add(gpu)
        pending = (st.pending == "ENABLED") if st.pending and st.pending != st.current else None
        if pending != node.mig_pending.get(gpu):
            out.append(Change("pending", gpu, pending))
    for gpu, sw in sorted(node.mig_switches.items()):
        if not sw.active or gpu in moved:
            continue
        now_st = statuses.get(gpu)
        if now_st is not None and now_st.current == _mode(sw.enable) and (gpu in node.mig_gpus) == sw.enable:
            out.append(Change("done", gpu))
            continue
        if acked < sw.revision:
            continue  # the agent may not have taken the assignment yet
        if now_st is None:
            why = "the agent reports no MIG mode for this GPU"
        elif now_st.error:
            why = now_st.error
        elif not now_st.switching and _mode(sw.enable) not in (now_st.current, now_st.pending):
            why = "the agent reports no switch under way (it may have restarted before switching)"
        else:
            continue
        out.append(Change("failed", gpu, why))
    return out


@dataclass
class MigModeReport(CycleCommand):
    """A --mig-manage agent's heartbeat reported MIG modes that change the view (SchedulerService.heartbeat)."""

    name: str
    statuses: dict[int, MigStatus]
    acked: int

    def execute(self, cycle: Cycle) -> bool:
        node = cycle.state.nodes.get(self.name)
        if node is None or not node.mig_manage or node.state == "LOST":
            return False
        changes = report_changes(node, self.statuses, max(self.acked, 0))
        if changes:
            apply_changes(cycle, node, changes)
        return bool(changes)


def apply_changes(cycle: Cycle, node: NodeRecord, changes: Sequence[Change]) -> None:
    now, work = cycle.now, cycle.work
    rebuild = False
    events = []
    for c in changes:
        gpu_id = node.gpu_ids.get(c.gpu)
        if gpu_id is None:
            continue
        if c.kind == "mode":
            sw = node.mig_switches.pop(c.gpu, None)
            values: dict[str, Any] = dict(
                mig_mode=_mode(c.value), mig_switched_at=now, mig_switch_to="", mig_switch_error="", mig_retry_after=0.0
            )
            node.mig_gpus = node.mig_gpus | {c.gpu} if c.value else node.mig_gpus - {c.gpu}
            if not c.value:  # out of MIG mode: no instance is left on it
                values["mig_instances"] = []
                node.foreign = {g: m for g, m in node.foreign.items() if g != c.gpu}
            node.mig_switched_at[c.gpu] = now
            work.write(ledger.set_gpu_mig, gpu_id, **values)
            asked_at = sw.asked_at if sw is not None and sw.active and sw.enable == c.value else None
            what = f"GPU {c.gpu} switched {'to' if c.value else 'out of'} MIG mode" + (
                f", {now - asked_at:.1f}s after the scheduler asked"
                if asked_at is not None
                else " (not asked by the scheduler)"
            )
            log.info(
                "node_mig_mode_changed",
                node=node.name,
                gpu=c.gpu,
                mig_mode=_mode(c.value),
                asked=asked_at is not None,
                mig_gpus=sorted(node.mig_gpus),
            )
            events.append(dict(at=now, gpu=c.gpu, severity="HEALTHY", kind="mig_mode", code=int(c.value), reason=what))
            rebuild = True
        elif c.kind == "pending":
            if c.value is None:
                node.mig_pending.pop(c.gpu, None)
            else:
                node.mig_pending[c.gpu] = c.value
            work.write(ledger.set_gpu_mig, gpu_id, mig_mode_pending="" if c.value is None else _mode(c.value))
            if c.value is not None:
                log.info(
                    "node_mig_mode_pending",
                    node=node.name,
                    gpu=c.gpu,
                    pending=_mode(c.value),
                    note="NVML applies it at the next GPU reset",
                )
        elif c.kind == "done":
            node.mig_switches.pop(c.gpu, None)
            node.mig_switched_at[c.gpu] = now
            work.write(
                ledger.set_gpu_mig,
                gpu_id,
                mig_switch_to="",
                mig_switch_error="",
                mig_retry_after=0.0,
                mig_switched_at=now,
            )
            rebuild = True
        elif c.kind == "failed":
            sw = node.mig_switches[c.gpu]
            backoff = cycle.settings.mig_switch_backoff_s
            error = str(c.value)[:2000] or "unknown error"
            node.mig_switches[c.gpu] = dataclasses.replace(sw, error=error, retry_after=now + backoff)
            work.write(ledger.set_gpu_mig, gpu_id, mig_switch_error=error, mig_retry_after=now + backoff)
            direction = "to" if sw.enable else "out of"
            log.warning(
                "mig_mode_switch_failed",
                node=node.name,
                gpu=c.gpu,
                mig_mode=_mode(sw.enable),
                error=error,
                retry_in_s=backoff,
            )
            events.append(
                dict(
                    at=now,
                    gpu=c.gpu,
                    severity="DEGRADED",
                    kind="mig_switch_failed",
                    code=0,
                    reason=f"GPU {c.gpu} could not switch {direction} MIG mode: {error}; not asked again "
                    f"for {backoff:g}s"[:2000],
                )
            )
            cycle.wake_at(now + backoff)
            rebuild = True
    work.write(ledger.add_node_events, node.id, events)
    if rebuild:
        cycle.state.rebuild_capacity()


def registered(cycle: Cycle, old: NodeRecord | None, node: NodeRecord, mig_manage: bool) -> bool:
    """A node registered (cycle.Register): carry its MIG switch state over to the new record, end the switches its
    registered modes show done, and fail those of an agent that no longer runs with --mig-manage. True when a
    switch ended (the capacity view must follow)."""
    node.mig_manage = mig_manage
    if old is None:
        return False
    now, work = cycle.now, cycle.work
    node.mig_switches = {g: s for g, s in old.mig_switches.items() if 0 <= g < node.gpus}
    node.mig_pending = {g: p for g, p in old.mig_pending.items() if 0 <= g < node.gpus}
    node.mig_switched_at = {g: t for g, t in old.mig_switched_at.items() if 0 <= g < node.gpus}
    for gpu in sorted(old.mig_gpus ^ node.mig_gpus):
        if gpu in node.gpu_ids:
            node.mig_switched_at[gpu] = now
            work.write(ledger.set_gpu_mig, node.gpu_ids[gpu], mig_switched_at=now)
    ended = False
    for gpu, sw in sorted(node.mig_switches.items()):
        if not sw.active or gpu not in node.gpu_ids:
            continue
        if (gpu in node.mig_gpus) == sw.enable:
            del node.mig_switches[gpu]
            work.write(
                ledger.set_gpu_mig, node.gpu_ids[gpu], mig_switch_to="", mig_switch_error="", mig_retry_after=0.0
            )
            ended = True
        elif not mig_manage:
            error = "the agent registered again without --mig-manage"
            node.mig_switches[gpu] = dataclasses.replace(sw, error=error, retry_after=now)
            work.write(ledger.set_gpu_mig, node.gpu_ids[gpu], mig_switch_error=error, mig_retry_after=now)
            log.warning("mig_mode_switch_failed", node=node.name, gpu=gpu, mig_mode=_mode(sw.enable), error=error)
            ended = True
    return ended


# ---- deciding --------------------------------------------------------------------------------------------------


@dataclass
class _Candidates:
    """Per direction: GPUs that may switch now, and those a hold or a failed switch's backoff keeps from it (GPU,
    until when, what happened, the flag that says how long)."""

    now: list[Gpu] = dataclasses.field(default_factory=list)
    later: list[tuple[Gpu, float, str, str]] = dataclasses.field(default_factory=list)


def candidates(state: SchedulerState, now: float, hold_s: float) -> dict[bool, _Candidates]:
    """The GPUs of --mig-manage nodes that may be switched into (True) or out of (False) MIG mode."""
    out = {True: _Candidates(), False: _Candidates()}
    for node in state.nodes.values():
        if not node.mig_manage or not node.schedulable or mig.mig_family(node.gpu_model, node.memory_mib) is None:
            continue
        cap = state.capacity.nodes.get(node.name)
        if cap is None:
            continue
        for gpu in range(node.gpus):
            if gpu in node.gpu_health or gpu in node.foreign or gpu in node.mig_pending:
                continue  # not healthy, someone else's instance, or a mode pending that we did not ask for
            sw = node.mig_switches.get(gpu)
            if sw is not None and sw.active:
                continue
            enable = gpu not in node.mig_gpus
            if (enable and gpu not in cap.free) or (not enable and cap.mig.get(gpu, 0)):
                continue  # in use: held whole, split into shares, or a MIG instance on it
            key = (node.name, gpu)
            if sw is not None and sw.retry_after > now:
                why = f"could not switch {'to' if sw.enable else 'out of'} MIG mode: {sw.error}"
                out[enable].later.append((key, sw.retry_after, why, "--mig-switch-backoff"))
                continue
            since = node.mig_switched_at.get(gpu, 0.0)
            if since and now < since + hold_s:
                out[enable].later.append(
                    (key, since + hold_s, f"changed its MIG mode at {_clock(since)}", "--mig-switch-hold")
                )
                continue
            out[enable].now.append(key)
    return out


def _fingerprint(state: SchedulerState) -> tuple:
    cap = state.capacity
    return (cap.free_gpus(), cap.unschedulable(), tuple(sorted((k, len(v)) for k, v in cap.shape_buckets().items())))


def _plan(
    cycle: Cycle,
    job: JobRecord,
    cands: list[Gpu],
    switching: dict[Gpu, bool],
    hidden: frozenset[str],
    taken: tuple[Placement, ...],
) -> SwitchPlan | None:
    state, req = cycle.state, job.request()
    key = (req, tuple(cands), tuple(sorted(switching.items())), hidden, taken, _fingerprint(state))
    memo = state.mig_plans.get(job.id)
    if memo is not None and memo[0] == key and cycle.now < memo[1]:
        return memo[2]
    plan = plan_switches(state.capacity, req, cands, switching, cycle.settings.fabric.tiers, hidden=hidden, taken=taken)
    if len(state.mig_plans) > 1000:
        state.mig_plans.clear()
    state.mig_plans[job.id] = (key, cycle.now + PLAN_TTL_S, plan)
    return plan


def after_pass(
    cycle: Cycle, head: JobRecord, result: Any, pending: Sequence[JobRecord], backfill: bool
) -> tuple[str | None, str]:
    """After a scheduling pass whose head is blocked: ask for the MIG mode switches that let it (or, with backfill,
    a gang behind it) fit. Returns the head's message while it waits for switches (None: it does not), and a note
    for its usual message otherwise (a hold or a failed switch keeps the GPUs it needs from switching now)."""
    state = cycle.state
    if not any(n.mig_manage for n in state.nodes.values()):
        return None, ""
    if any(j.preempted_by == head.id for j in state.jobs.in_state("RUNNING").values()):
        return None, ""  # a preemption for it is under way: it gets those GPUs
    switching = {(n.name, g): s.enable for n in state.nodes.values() for g, s in n.mig_switches.items() if s.active}
    cands = candidates(state, cycle.now, cycle.settings.mig_switch_hold_s)
    budget = [True]  # one gang's switches per cycle
    plan, note = _serve(cycle, head, cands, switching, budget, frozenset(), ())
    message = _waiting(cycle, plan) if plan is not None else None
    if not backfill:
        return message, note
    region = frozenset(result.reservation.nodes) if result.reservation is not None else frozenset()
    taken: tuple[Placement, ...] = (plan.placement,) if plan is not None else ()
    skip = set(result.quota_blocked)
    behind = sorted(
        (
            j
            for j in pending
            if j.state == "PENDING"
            and j is not head
            and j.id not in skip
            and (
                cands[bool(j.mig_profile)].now
                or bool(j.mig_profile) in switching.values()
                or j.message.startswith(WAITING)
            )
        ),
        key=lambda j: (-j.priority, j.submitted_at, j.id),
    )
    for job in behind[:MAX_BEHIND]:
        got, why = _serve(cycle, job, cands, switching, budget, region, taken)
        if why is DEFERRED:
            continue
        if got is not None:
            taken += (got.placement,)
            text = _waiting(cycle, got)
        elif job.message.startswith(WAITING):
            text = "queued (no longer waiting for a MIG mode switch)"
        else:
            continue
        if job.message != text:
            set_job(cycle, job, message=text)
            cycle.touched(job)
    return message, note


def _serve(
    cycle: Cycle,
    job: JobRecord,
    cands: dict[bool, _Candidates],
    switching: dict[Gpu, bool],
    budget: list[bool],
    hidden: frozenset[str],
    taken: tuple[Placement, ...],
) -> tuple[SwitchPlan | None, str]:
    """The switches `job` waits for (asking for them when the budget allows), or None, with a note on the GPUs that a
    hold or a backoff keeps from switching for it (DEFERRED: it needs switches, asked in a later cycle)."""
    enable = wants_mig_mode(job.request())
    mine = cands[enable]
    if not mine.now and enable not in switching.values() and not mine.later:
        return None, ""
    plan = _plan(cycle, job, mine.now, switching, hidden, taken) if (mine.now or enable in switching.values()) else None
    if plan is None:
        return None, _later_note(cycle, job, mine, switching, hidden, taken)
    if not plan.switch and not plan.waiting:
        return None, ""  # it fits as things are: the next pass places it
    if plan.switch:
        if not budget[0]:
            cycle.wake_at(cycle.now + 0.2)  # another gang's switches were asked in this cycle: the next one
            return None, DEFERRED
        budget[0] = False
        _ask(cycle, job, plan)
        for gpu in plan.switch:
            switching[gpu] = enable
            if gpu in mine.now:
                mine.now.remove(gpu)
    return plan, ""


def _later_note(
    cycle: Cycle,
    job: JobRecord,
    mine: _Candidates,
    switching: dict[Gpu, bool],
    hidden: frozenset[str],
    taken: tuple[Placement, ...],
) -> str:
    """When GPUs kept back by a hold or a backoff would make the gang fit: which, and until when (a cycle runs
    then)."""
    if not mine.later:
        return ""
    later = {gpu: (until, why, flag) for gpu, until, why, flag in mine.later}
    plan = plan_switches(
        cycle.state.capacity,
        job.request(),
        [*mine.now, *later],
        switching,
        cycle.settings.fabric.tiers,
        hidden=hidden,
        taken=taken,
    )
    if plan is None:
        return ""
    kept = [gpu for gpu in plan.switch if gpu in later]
    if not kept:
        return ""
    cycle.wake_at(min(later[gpu][0] for gpu in kept))
    parts = [
        f"GPU {g} of {n} {why}: not switched before {_clock(until)} ({flag})"
        for n, g in kept
        for until, why, flag in (later[(n, g)],)
    ]
    return "; " + "; ".join(parts)


def _ask(cycle: Cycle, job: JobRecord, plan: SwitchPlan) -> None:
    """Send SetMigMode to the nodes (durable assignments) and hold the GPUs out of placement until they switched."""
    state, now = cycle.state, cycle.now
    what = (
        f"{job.replicas} x {job.mig_profile}"
        if job.mig_profile
        else f"{job.replicas} x {job.gpu_milli}/1000 GPU"
        if job.gpu_milli
        else f"{job.replicas} x {job.gpus_per_replica} GPUs"
    )
    reason = (
        f"job {job.id} ({job.name[:64]}) needs {what}; no GPU {'in' if plan.enable else 'out of'} MIG mode has room"
    )
    revisions: dict[Gpu, int] = {}
    for name, gpu in plan.switch:

        def build(rev: int, key: Gpu = (name, gpu)) -> agent_pb2.Assignment:
            revisions[key] = rev
            return agent_pb2.Assignment(
                revision=rev, set_mig_mode=agent_pb2.SetMigMode(gpu=key[1], enable=plan.enable, reason=reason)
            )

        cycle.send(state.nodes[name], job.id, 0, "set_mig_mode", build)
    cycle.flush()  # the revisions, for the switch records
    for name, gpu in plan.switch:
        node = state.nodes[name]
        rev = revisions[(name, gpu)]
        node.mig_switches[gpu] = MigSwitch(plan.enable, now, rev)
        cycle.work.write(
            ledger.set_gpu_mig,
            node.gpu_ids[gpu],
            mig_switch_to=_mode(plan.enable),
            mig_switch_at=now,
            mig_switch_revision=rev,
            mig_switch_error="",
            mig_retry_after=0.0,
        )
        state.capacity.take(name, [gpu])  # out of placement while it switches
        log.info("mig_mode_switch_asked", node=name, gpu=gpu, mig_mode=_mode(plan.enable), job=job.id, revision=rev)
    state.mig_plans.pop(job.id, None)


def _waiting(cycle: Cycle, plan: SwitchPlan) -> str:
    """The message of a gang that waits for MIG mode switches."""
    nodes = cycle.state.nodes
    by_node: dict[str, list[int]] = {}
    for name, gpu in plan.gpus:
        by_node.setdefault(name, []).append(gpu)
    where = " and ".join(
        f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, sorted(gpus)))} of {name}"
        for name, gpus in sorted(by_node.items())
    )
    asked = [nodes[n].mig_switches[g].asked_at for n, g in plan.gpus if n in nodes and g in nodes[n].mig_switches]
    ago = f" (asked {_ago(cycle.now - min(asked))} ago)" if asked else ""
    reset = [(n, g) for n, g in plan.gpus if n in nodes and nodes[n].mig_pending.get(g) == plan.enable]
    message = f"waiting for {where} to switch {'to' if plan.enable else 'out of'} MIG mode{ago}"
    if reset:
        message += (
            f"; the new mode of {', '.join(f'GPU {g} of {n}' for n, g in reset)} is pending until a GPU "
            "reset applies it (nvidia-smi -r)"
        )
    return message + ", holding no GPUs"


def _ago(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{int(s)} s"
    if s < 3600:
        return f"{int(s // 60)} min"
    return f"{int(s // 3600)} h"


def _clock(ts: float) -> str:
    if not math.isfinite(ts):
        return "never"
    return time.strftime("%H:%M:%S", time.gmtime(ts)) + " UTC"
