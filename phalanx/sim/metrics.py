"""The metrics of a replay once it ran: completion and delays, utilization and goodput, placement, preemption,
and what each tenant and each priority class got against its entitlement (:class:`SimResult`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from phalanx.core.goodput import Goodput, account_job
from phalanx.core.quota import demand

from .fairness import _jain, _tenant


@dataclass
class SimResult:
    policy: str
    metrics: dict[str, Any]
    timeline: list[tuple[float, float]]  # (time, allocated GPU fraction)
    jct: list[float]


def replay_result(replay: Any) -> SimResult:
    """The metrics of `replay` (a `phalanx.sim.engine._Replay`) once it ran (`_Replay.result`; typed Any: this
    module is imported by the engine, not the other way): completion, utilization, goodput, delays, placement,
    preemption, and per tenant and per priority class."""
    states, total = replay.states, replay.total
    # Once every job is done, the makespan ends with the last one (not with a later no-op event, such as a
    # wake-up for a preemption that was no longer needed).
    makespan = max(replay.last_finish if states and replay.done == len(states) else replay.now, 1e-9)
    replay.now = makespan
    replay.fair_account()  # up to the end (a replay that stopped early has not integrated its last interval)
    fair = replay.fair
    finished = [s for s in states.values() if s.finish is not None]
    jct = sorted(s.finish - s.job.submit_s for s in finished)
    waits = sorted(s.first_start - s.job.submit_s for s in states.values() if s.first_start is not None)
    goodput = Goodput()
    for s in states.values():
        gpus = demand(s.request)[0]
        goodput += account_job(s.job.submit_s, gpus, s.attempts, makespan, finished_at=s.finish)
    delivered = sum(demand(s.request)[0] * s.job.duration_s for s in finished)

    def q(values: list[float], p: float) -> float:
        return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] if values else float("nan")

    multi_node, passes = replay.multi_node, replay.passes
    wall = time.perf_counter() - replay.started_wall
    metrics = {
        "policy": replay.policy,
        "jobs": len(states),
        "completed": len(finished),
        "deadlocked": replay.deadlocked,
        "makespan_h": makespan / 3600,
        "jobs_per_hour": len(finished) / (makespan / 3600),
        "gpu_hours_delivered": delivered / 3600,
        "utilization_allocated": replay.area_alloc / (total * makespan),
        "utilization_productive": goodput.productive / (total * makespan),
        "goodput": goodput.as_dict() | {"ratio": goodput.ratio},
        "jct_mean_h": statistics.fmean(jct) / 3600 if jct else float("nan"),
        "jct_median_h": q(jct, 50) / 3600,
        "jct_p99_h": q(jct, 99) / 3600,
        "queue_delay_mean_h": statistics.fmean(waits) / 3600 if waits else float("nan"),
        "queue_delay_median_h": q(waits, 50) / 3600,
        "queue_delay_p99_h": q(waits, 99) / 3600,
        "multi_node_gangs": multi_node,
        "within_one_leaf": replay.within_leaf / multi_node if multi_node else 1.0,
        "leaf_crossings_per_multi_node_gang": replay.leaves_crossed / multi_node if multi_node else 0.0,
        "idle_gpu_hours_while_jobs_wait": replay.area_idle_waiting / 3600,
        "hoarded_gpu_hours": replay.area_hoard / 3600,
        "cross_spine_tb": replay.cross_spine_bytes / 1e12,
        "scheduling_passes": passes,
        "preemptions": replay.preemptions,
        "reclaims": replay.reclaims,
        "preempt_lost_gpu_hours": replay.preempt_lost / 3600,
        "peak_running_jobs": replay.peak_running,
        "events_per_s": (len(states) * 2 + passes) / max(wall, 1e-9),
        "wall_s": wall,
    }
    # Per tenant: what each got, against its quota's share of the cluster (quotas on) or an equal share.
    tenants: dict[str, dict[str, Any]] = {}
    for s in states.values():
        t = tenants.setdefault(
            _tenant(s.job), {"jobs": 0, "completed": 0, "gpu_hours": 0.0, "jct": [], "wait": [], "preempted": 0}
        )
        t["jobs"] += 1
        t["preempted"] += s.preempted
        t["gpu_hours"] += demand(s.request)[0] * s.job.duration_s / 3600
        if s.finish is not None:
            t["completed"] += 1
            t["jct"].append((s.finish - s.job.submit_s) / 3600)
        if s.first_start is not None:
            t["wait"].append((s.first_start - s.job.submit_s) / 3600)
    nominal = {n: sum(q.gpus for q in spec.quotas.values()) for n, spec in (replay.quotas or {}).items()}
    all_nominal = sum(nominal.values()) or 0.0
    for name, t in tenants.items():
        jct_t, wait_t = t.pop("jct"), t.pop("wait")
        t["jct_mean_h"] = statistics.fmean(jct_t) if jct_t else float("nan")
        t["queue_delay_mean_h"] = statistics.fmean(wait_t) if wait_t else float("nan")
        t["quota_share"] = nominal.get(name, 0.0) / all_nominal if all_nominal else 1 / len(tenants)
    # Fairness against the quotas: what each tenant held over the run (GPU-hours received) against its
    # entitlement (at every moment, its quota's weighted max-min share of the cluster over what the tenants
    # wanted then), and Jain's index over those ratios (1: every tenant got the same fraction of its entitlement).
    received_all = sum(fair["got_s"].values())
    ratios = []
    for name, t in tenants.items():
        got, entitled = fair["got_s"][name], fair["entitled_s"][name]
        t["gpu_hours_received"] = got / 3600
        t["gpu_hours_entitled"] = entitled / 3600
        t["received_share"] = got / received_all if received_all > 0 else 0.0
        t["fair_ratio"] = got / entitled if entitled > 0 else float("nan")
        if entitled > 0:
            ratios.append(got / entitled)
    metrics["fairness_jain"] = _jain(ratios)
    metrics["tenants"] = tenants
    # Per priority class (the mix's pre-training gangs, team jobs and fine-tuning jobs): who preemption serves.
    classes: dict[int, dict[str, Any]] = {}
    for s in states.values():
        c = classes.setdefault(s.request.priority, {"jobs": 0, "completed": 0, "preempted": 0, "jct": [], "wait": []})
        c["jobs"] += 1
        c["preempted"] += s.preempted
        if s.finish is not None:
            c["completed"] += 1
            c["jct"].append((s.finish - s.job.submit_s) / 3600)
        if s.first_start is not None:
            c["wait"].append((s.first_start - s.job.submit_s) / 3600)
    for c in classes.values():
        jct_c, wait_c = c.pop("jct"), c.pop("wait")
        c["jct_mean_h"] = statistics.fmean(jct_c) if jct_c else float("nan")
        c["queue_delay_mean_h"] = statistics.fmean(wait_c) if wait_c else float("nan")
    metrics["priorities"] = {str(p): classes[p] for p in sorted(classes, reverse=True)}
    return SimResult(replay.policy, metrics, replay.timeline, jct)
