"""A discrete-event replay of a job trace through the scheduler's own core (no copy of it, no vectorised stand-in).

Every scheduling pass is `phalanx.core.backfill.schedule_with_backfill` on a `phalanx.core.capacity.ClusterCapacity`,
the very call the scheduler's cycle makes; placements are `phalanx.core.placement.place_gang`. Policies:

- `pod` (a): per-container, no gang semantics, as a stock Kubernetes scheduler: replicas are placed one by one as
  they fit (the pods of every waiting gang compete, one each per round), a gang starts once all are placed, and a
  partly placed gang holds its GPUs meanwhile (hoarding). When no replica can be placed and nothing runs, the
  cluster is deadlocked (the result says since when); the replay goes on with what still fits.
- `gang-fifo` (b): whole gangs, strict priority/FIFO order.
- `gang-backfill` (c): whole gangs with EASY backfill, placed without topology (every node alike).
- `topo` (d): (c) with topology-aware placement (the fabric's leaves and spines).
- `topo-mig` (f): (d), and jobs asking for part of a GPU get a share (`gpu_milli`) instead of a whole GPU.
Declared time limits (for backfill) are twice a job's duration. A job's run time is its trace duration times the
slowdown its placement costs (`speed`, default 1: the network model plugs in there).

Failures (`failures_per_gpu_day`, exponential per node): a failed node is out for `repair_s`; every gang on it is
torn down and requeued. With checkpointing (`checkpoint="young-daly"`) it restarts from its last checkpoint (taken
every Young/Daly interval, each costing `checkpoint_cost_s`), otherwise from scratch.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from phalanx.core.backfill import RunningEnd, schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.checkpoint_policy import young_daly_interval
from phalanx.core.fabric import default_fabric
from phalanx.core.goodput import AttemptTimes, Goodput, account_job
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.core.quota import DEFAULT_QUEUE, FlavorQuota, QueueSpec, QuotaBook, demand, usage_of

from .network import NetJob, NetworkSpec, NetworkState, allreduce_time

# Gradient bytes AllReduced per step when the trace does not say: a 1B-parameter model in bf16.
DEFAULT_MESSAGE_BYTES = 2e9

POLICIES = ("pod", "gang-fifo", "gang-backfill", "topo", "topo-mig")


class Job(Protocol):
    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    gpu_milli: int
    duration_s: float


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus: int = 8
    per_leaf: int = 32
    leaves_per_spine: int = 16
    oversub: float = 1.0  # leaf -> spine oversubscription for the network model (1: non-blocking)

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """"NODESxGPUS[,leaf=N][,spine=N][,oversub=R]", e.g. "512x8,leaf=32,spine=16,oversub=2"."""
        head, *opts = [p.strip() for p in text.split(",")]
        try:
            nodes, _, gpus = head.lower().partition("x")
            spec = {"nodes": int(nodes), "gpus": int(gpus or 8)}
            for opt in opts:
                key, _, value = opt.partition("=")
                name = {"leaf": "per_leaf", "spine": "leaves_per_spine", "oversub": "oversub"}[key]
                spec[name] = float(value) if name == "oversub" else int(value)
        except (ValueError, KeyError):
            raise ValueError(f"cluster {text!r}: give NODESxGPUS[,leaf=N][,spine=N][,oversub=R], e.g. "
                             "512x8,leaf=32") from None
        out = cls(**spec)
        if min(out.nodes, out.gpus, out.per_leaf, out.leaves_per_spine, out.oversub) < 1:
            raise ValueError(f"cluster {text!r}: every number must be >= 1")
        return out

    def fabric(self):
        names = [f"n{i:05d}" for i in range(self.nodes)]
        return default_fabric(names, nodes_per_leaf=self.per_leaf, leaves_per_spine=self.leaves_per_spine)

    def build(self, topology: bool = True) -> tuple[ClusterCapacity, tuple[str, ...], dict[str, tuple[str, ...]]]:
        fabric = self.fabric()
        paths = {n: fabric.path(n) for n in fabric.paths}
        cap = ClusterCapacity(NodeCapacity(n, self.gpus, set(range(self.gpus)), True, paths[n] if topology else ())
                              for n in paths)
        return cap, (fabric.tiers if topology else ()), paths


@dataclass
class _State:
    job: Any
    request: GangRequest
    remaining_s: float  # work left at full speed
    attempts: list[AttemptTimes] = field(default_factory=list)
    first_start: float | None = None
    finish: float | None = None
    partial: list[Placement] = field(default_factory=list)  # pod policy: replicas placed so far
    placement: Placement | None = None
    started: float = 0.0
    end_seq: int = 0
    work_left: float = 0.0  # seconds of this attempt's work left at full speed (checkpoint writes included)
    attempt_work: float = 0.0  # full-speed seconds done in this attempt
    rate: float = 1.0  # speed now: full-speed step time / step time on its placement with today's contention
    last: float = 0.0
    ideal_step: float = 0.0
    flavor: str = ""  # the quota flavor it runs under (quotas on)


@dataclass
class SimResult:
    policy: str
    metrics: dict[str, Any]
    timeline: list[tuple[float, float]]  # (time, allocated GPU fraction)
    jct: list[float]


def simulate(jobs: Sequence[Job], cluster: ClusterSpec, policy: str, *, failures_per_gpu_day: float = 0.0,
             checkpoint: str = "young-daly", checkpoint_cost_s: float = 60.0, repair_s: float = 3600.0,
             seed: int = 0, speed: Callable[[Job, Placement], float] | None = None, depth: int = 200,
             network: NetworkSpec | None = None, comm_fraction: float = 0.2,
             quotas: Mapping[str, QueueSpec] | None = None,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    rng = random.Random(seed)
    topology = policy in ("topo", "topo-mig")
    cap, tiers, paths = cluster.build(topology)
    total = cluster.nodes * cluster.gpus
    states: dict[str, _State] = {}
    for j in jobs:
        milli = j.gpu_milli if policy == "topo-mig" and j.gpu_milli else 0
        request = GangRequest(j.job_id, j.replicas, j.gpus_per_replica, 0, j.submit_s, gpu_milli=milli,
                              time_limit=2 * max(j.duration_s, 1.0))
        states[j.job_id] = _State(j, request, j.duration_s)
    events: list[tuple[float, int, str, str]] = []
    seq = 0

    def push(t: float, kind: str, key: str) -> int:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, key))
        return seq

    for j in jobs:
        push(j.submit_s, "arrive", j.job_id)
    node_rate = failures_per_gpu_day * cluster.gpus / 86400.0
    if node_rate > 0:
        for n in cap.nodes:
            push(rng.expovariate(node_rate), "fail", n)
    pending: dict[str, _State] = {}
    running: dict[str, _State] = {}
    down: set[str] = set()
    now = last = 0.0
    allocated = 0.0
    area_alloc = area_idle_waiting = area_hoard = 0.0
    timeline: list[tuple[float, float]] = []
    done = 0
    deadlocked: float | bool = False
    started_wall = time.perf_counter()
    passes = 0
    within_leaf = multi_node = 0
    leaves_crossed = 0
    interval_of: dict[str, float] = {}
    net = NetworkState(cluster.fabric(), network) if network is not None else None
    memo: dict = {}  # the scheduler's memo of the head's reservation, kept across passes as the cycle keeps it
    cross_spine_bytes = 0.0

    def tenant_of(st: _State) -> str:
        return getattr(st.job, "tenant", "") or DEFAULT_QUEUE

    def held(st: _State) -> float:
        if st.placement is not None:
            return demand(st.request)[0]
        return len(st.partial) * demand(st.request)[0] / st.request.replicas

    def work_of(st: _State, placement: Placement) -> float:
        work = st.remaining_s
        if checkpoint == "young-daly" and node_rate > 0:
            nodes = max(1, len(set(placement.nodes)))
            interval = young_daly_interval(checkpoint_cost_s, 1 / (node_rate * nodes))
            interval_of[st.job.job_id] = interval
            work += math.floor(work / interval) * checkpoint_cost_s
        return work

    def net_job(st: _State, placement: Placement) -> NetJob | None:
        """The job's AllReduce per step (gradient bytes) and compute per step, set so that on the best placement
        of its shape (one node: NVLink; else whole rails per node) communication is `comm_fraction` of a step."""
        r = st.request
        ranks = r.replicas * r.gpus_per_replica
        if net is None or ranks < 2 or r.gpu_milli:
            return None
        message = float(getattr(st.job, "param_bytes", 0) or DEFAULT_MESSAGE_BYTES)
        best = network.nvlink_bw if r.replicas == 1 else min(network.nvlink_bw,
                                                               r.gpus_per_replica * network.ib_rail_bw)
        ideal_comm = allreduce_time(message, ranks, best)
        compute = ideal_comm * (1 - comm_fraction) / comm_fraction
        st.ideal_step = compute + ideal_comm
        return NetJob(placement, message, compute)

    def settle(changed) -> None:
        """Jobs whose bandwidth changed: account the work done at the old speed, go on at the new one."""
        for job_id in changed:
            st = running.get(job_id)
            if st is None:
                continue
            advance(st)
            st.rate = min(1.0, st.ideal_step / net.step_time(job_id)) if st.ideal_step else 1.0
            st.end_seq = push(now + st.work_left / st.rate, "finish", job_id)

    def advance(st: _State) -> None:
        nonlocal cross_spine_bytes
        done_work = (now - st.last) * st.rate
        st.work_left -= done_work
        st.attempt_work += done_work
        if net is not None and st.ideal_step and st.job.job_id in net:
            cross_spine_bytes += net.cross_spine_bytes(st.job.job_id) * done_work / st.ideal_step
        st.last = now

    def start(st: _State, placement: Placement) -> None:
        nonlocal allocated, within_leaf, multi_node, leaves_crossed
        st.placement = placement
        st.started = st.last = now
        if st.first_start is None:
            st.first_start = now
        st.attempts.append(AttemptTimes(len(st.attempts) + 1, held(st), now, now))
        allocated += held(st)
        st.work_left, st.attempt_work, st.ideal_step = work_of(st, placement), 0.0, 0.0
        slow = speed(st.job, placement) if speed else 1.0
        st.rate = 1.0 / slow if slow > 0 else 1.0
        running[st.job.job_id] = st
        pending.pop(st.job.job_id, None)
        job = net_job(st, placement)
        if job is not None:
            settle(net.add(job))
        else:
            st.end_seq = push(now + st.work_left / st.rate, "finish", st.job.job_id)
        nodes = set(placement.nodes)
        if len(nodes) > 1:
            multi_node += 1
            leaves = {paths[n][0] for n in nodes}
            within_leaf += len(leaves) == 1
            leaves_crossed += len(leaves) - 1

    def stop(st: _State, *, finished: bool) -> None:
        nonlocal allocated, done
        advance(st)
        allocated -= held(st)
        cap.release_placement(st.placement)
        a = st.attempts[-1]
        if finished:
            st.attempts[-1] = AttemptTimes(a.attempt, a.gpus, a.reserved_at, a.running_at, now, "SUCCEEDED")
            st.finish = now
            done += 1
        else:  # torn down by a failure: keep what the last checkpoint saved
            kept = 0.0
            interval = interval_of.get(st.job.job_id)
            if checkpoint == "young-daly" and interval:
                kept = math.floor(st.attempt_work / (interval + checkpoint_cost_s)) * interval
            st.remaining_s = max(0.0, st.remaining_s - kept)
            wall = now - a.running_at
            kept_wall = wall * kept / st.attempt_work if st.attempt_work > 0 else 0.0
            st.attempts[-1] = AttemptTimes(a.attempt, a.gpus, a.reserved_at, a.running_at, now, "NODE_LOST",
                                           kept_until=a.running_at + kept_wall if kept else None)
            pending[st.job.job_id] = st
        st.placement = None
        running.pop(st.job.job_id, None)
        if net is not None and st.job.job_id in net:
            settle(net.remove(st.job.job_id))

    def schedule() -> None:
        nonlocal passes, deadlocked
        passes += 1
        if policy == "pod":
            # Pods of every waiting gang compete, one replica each per round (as a per-pod scheduler sees them),
            # until no replica fits: partly placed gangs keep what they got.
            progress_made = False
            order = sorted(pending.values(), key=lambda s: (s.request.submitted_at, s.job.job_id))
            placed_one = True
            while placed_one:
                placed_one = False
                for st in order:
                    r = st.request
                    if st.placement is not None or len(st.partial) >= r.replicas:
                        continue
                    one = GangRequest(f"{r.job_id}/{len(st.partial)}", 1, r.gpus_per_replica)
                    got = place_gang(cap, one, tiers)
                    if isinstance(got, Placement):
                        cap.reserve(got)
                        st.partial.append(got)
                        placed_one = progress_made = True
            for st in order:
                r = st.request
                if st.placement is None and len(st.partial) == r.replicas:
                    reps = tuple(ReplicaPlacement(i, p.replicas[0].node, p.replicas[0].gpus)
                                 for i, p in enumerate(st.partial))
                    st.partial = []
                    start(st, Placement(r.job_id, reps, "", 0, 0.0, "per-container"))
            if not progress_made and not running and any(s.partial for s in pending.values()) and not deadlocked:
                deadlocked = now  # partly placed gangs hold what the others need: nothing can ever start
            return
        book = None
        if quotas:
            book = QuotaBook(quotas, usage_of((tenant_of(s), s.flavor, s.request) for s in running.values()),
                             {"gpus": float(total)})
        result = schedule_with_backfill(
            cap, [s.request for s in pending.values()], tiers, now=now,
            running=lambda: [RunningEnd(s.job.job_id, s.placement, s.started + s.request.time_limit)
                             for s in running.values()],
            backfill=policy != "gang-fifo", depth=depth, book=book, memo=memo,
            queues={s.job.job_id: tenant_of(s) for s in pending.values()} if book else None)
        for placement in result.placements:
            st = pending[placement.job_id]
            st.flavor = result.flavors.get(placement.job_id, "")
            start(st, placement)

    while events:
        # A finish event superseded by a speed change (or a teardown) is dropped before the clock moves to it.
        top = events[0]
        if top[2] == "finish" and (top[3] not in running or running[top[3]].end_seq != top[1]):
            heapq.heappop(events)
            continue
        t = events[0][0]
        waiting = bool(pending)
        free = total - allocated - sum(held(s) for s in pending.values() if s.partial)
        area_alloc += allocated * (t - last)
        if waiting:
            area_idle_waiting += max(0.0, free) * (t - last)
        area_hoard += sum(held(s) for s in pending.values() if s.partial) * (t - last)
        now = last = t
        while events and events[0][0] == t:
            _, ev_seq, kind, key = heapq.heappop(events)
            if kind == "arrive":
                pending[key] = states[key]
            elif kind == "finish":
                st = running.get(key)
                if st is not None and st.end_seq == ev_seq:
                    stop(st, finished=True)
                    if progress is not None and done % 500 == 0:
                        progress(done, len(states))
            elif kind == "fail":
                if key not in down:
                    down.add(key)
                    cap.set_schedulable(key, False)
                    for st in [s for s in running.values() if key in s.placement.nodes]:
                        stop(st, finished=False)
                    push(now + repair_s, "repair", key)
            elif kind == "repair":
                down.discard(key)
                cap.set_schedulable(key, True)
                push(now + rng.expovariate(node_rate), "fail", key)
        if node_rate > 0 and not pending and not running and done == len(states):
            break
        schedule()
        if not timeline or now - timeline[-1][0] >= 60.0:
            timeline.append((now, allocated / total))
    makespan = max(now, 1e-9)
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

    metrics = {
        "policy": policy, "jobs": len(states), "completed": len(finished), "deadlocked": deadlocked,
        "makespan_h": makespan / 3600, "jobs_per_hour": len(finished) / (makespan / 3600),
        "gpu_hours_delivered": delivered / 3600,
        "utilization_allocated": area_alloc / (total * makespan),
        "utilization_productive": goodput.productive / (total * makespan),
        "goodput": goodput.as_dict() | {"ratio": goodput.ratio},
        "jct_mean_h": statistics.fmean(jct) / 3600 if jct else float("nan"),
        "jct_median_h": q(jct, 50) / 3600, "jct_p99_h": q(jct, 99) / 3600,
        "queue_delay_mean_h": statistics.fmean(waits) / 3600 if waits else float("nan"),
        "queue_delay_median_h": q(waits, 50) / 3600, "queue_delay_p99_h": q(waits, 99) / 3600,
        "multi_node_gangs": multi_node,
        "within_one_leaf": within_leaf / multi_node if multi_node else 1.0,
        "leaf_crossings_per_multi_node_gang": leaves_crossed / multi_node if multi_node else 0.0,
        "idle_gpu_hours_while_jobs_wait": area_idle_waiting / 3600,
        "hoarded_gpu_hours": area_hoard / 3600,
        "cross_spine_tb": cross_spine_bytes / 1e12,
        "scheduling_passes": passes,
        "events_per_s": (len(states) * 2 + passes) / max(time.perf_counter() - started_wall, 1e-9),
        "wall_s": time.perf_counter() - started_wall,
    }
    # Per tenant: what each got, against its quota's share of the cluster (quotas on) or an equal share.
    tenants: dict[str, dict[str, Any]] = {}
    for s in states.values():
        t = tenants.setdefault(tenant_of(s), {"jobs": 0, "completed": 0, "gpu_hours": 0.0, "jct": [], "wait": []})
        t["jobs"] += 1
        t["gpu_hours"] += demand(s.request)[0] * s.job.duration_s / 3600
        if s.finish is not None:
            t["completed"] += 1
            t["jct"].append((s.finish - s.job.submit_s) / 3600)
        if s.first_start is not None:
            t["wait"].append((s.first_start - s.job.submit_s) / 3600)
    nominal = {n: sum(q.gpus for q in spec.quotas.values()) for n, spec in (quotas or {}).items()}
    all_nominal = sum(nominal.values()) or 0.0
    for name, t in tenants.items():
        jct_t, wait_t = t.pop("jct"), t.pop("wait")
        t["jct_mean_h"] = statistics.fmean(jct_t) if jct_t else float("nan")
        t["queue_delay_mean_h"] = statistics.fmean(wait_t) if wait_t else float("nan")
        t["quota_share"] = nominal.get(name, 0.0) / all_nominal if all_nominal else 1 / len(tenants)
    metrics["tenants"] = tenants
    return SimResult(policy, metrics, timeline, jct)


def equal_quotas(jobs: Sequence[Job], total_gpus: int, cohort: str = "all") -> dict[str, QueueSpec]:
    """One queue per tenant with an equal share of the cluster as its nominal quota, all in one cohort (idle quota is
    lent, and reclaimed when its owner needs it)."""
    tenants = sorted({getattr(j, "tenant", "") or DEFAULT_QUEUE for j in jobs})
    share = total_gpus / max(1, len(tenants))
    return {t: QueueSpec(t, {"*": FlavorQuota(gpus=share)}, cohort=cohort) for t in tenants}
