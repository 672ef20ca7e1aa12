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
- `topo-preempt` (e): (d) with preemption and checkpoint-restart (below).
- `topo-mig` (f): (e), and jobs asking for part of a GPU get a share (`gpu_milli`) instead of a whole GPU.
Every gang policy serves the queue in priority order (a job's `priority`, default 0), then submission.
Declared time limits (for backfill) are twice a job's duration. A job's run time is its trace duration times the
slowdown its placement costs (`speed`, default 1: the network model plugs in there).

Failures (`failures_per_gpu_day`, exponential per node): a failed node is out for `repair_s`; every gang on it is
torn down and requeued. With checkpointing (`checkpoint="young-daly"`) it restarts from its last checkpoint (taken
every Young/Daly interval, each costing `checkpoint_cost_s`), otherwise from scratch.

Preemption (`topo-preempt`, `topo-mig`), as the scheduler's cycle does it (services/scheduler/cycle.py `preempt_for`),
through the core's `phalanx.core.preemption.choose_victims`: when the head of the queue is blocked, whole running
gangs of strictly lower priority that have run at least `min_runtime_s` are candidates, and the minimal set whose
release makes the head fit is chosen. With quotas, a head within its queue's nominal quota may also evict gangs of
other queues of its cohort that run on borrowed quota, whatever their priority (they count as just below its
priority: reclaim). A victim is asked to checkpoint: it stops making progress at that moment, keeps all the work
done so far, writes the checkpoint for `checkpoint_cost_s` while still holding its GPUs (the grace), and is then
torn down and requeued with its remaining work (goodput outcome "PREEMPTED"; the grace counts as rollback). The
preemptor starts at that handover. With `checkpoint="none"` a victim is stopped at once and loses its attempt's
work. While a preemption is under way, nothing is backfilled (its plan counts on the GPUs free now), as in the
cycle; unlike the cycle, a victim once asked is stopped even if its preemptor found room elsewhere meanwhile.
The preemptor is placed first at the handover, on the GPUs its victims freed (the cycle's atomic handover), even
ahead of a requeued victim that outranks it (a quota reclaim). A head that would run on borrowed quota may preempt
only its own queue's gangs, as in the cycle (Kueue's `borrowWithinCohort: Never`); `borrower_preempts=True` lets it
preempt any queue's lower-priority gangs, and then a gang larger than its queue's quota (always borrowing) and the
queues reclaiming from it evict each other in turn, each after `min_runtime_s` (6,643 preemptions against 12 on a
2,000-job multi-tenant mix).
Metrics: `preemptions` (victims torn down), `reclaims` (of them, evicted for quota reclaim),
`preempt_lost_gpu_hours` (the victims' checkpoint grace plus any work rolled back).
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

from phalanx.core.backfill import RunningEnd, RunningSet, schedule_with_backfill
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.checkpoint_policy import young_daly_interval
from phalanx.core.fabric import default_fabric
from phalanx.core.goodput import AttemptTimes, Goodput, account_job
from phalanx.core.model import GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.core.preemption import NoPreemption, PreemptionPolicy, RunningGang, choose_victims
from phalanx.core.quota import DEFAULT_QUEUE, FlavorQuota, QueueSpec, QuotaBook, demand, usage_of

from .network import NetJob, NetworkSpec, NetworkState, allreduce_time

# Gradient bytes AllReduced per step when the trace does not say: a 1B-parameter model in bf16.
DEFAULT_MESSAGE_BYTES = 2e9

POLICIES = ("pod", "gang-fifo", "gang-backfill", "topo", "topo-preempt", "topo-mig")
PREEMPTING = ("topo-preempt", "topo-mig")


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
    evict_by: str = ""  # preemption: the gang it makes way for, while it writes its checkpoint (the grace)
    evict_at: float = 0.0  # when it was asked to checkpoint (its progress stopped then)
    evict_reclaim: bool = False  # evicted for quota reclaim rather than for priority
    preempted: int = 0  # times it was preempted


class _Running(dict):
    """The running gangs by id, and the same gangs in end order (`ends`, a `RunningSet`) for the scheduling pass,
    kept as they start and stop: a pass with a blocked head then neither lists nor sorts them."""

    def __init__(self) -> None:
        super().__init__()
        self.ends = RunningSet()

    def __setitem__(self, job_id: str, st: _State) -> None:
        super().__setitem__(job_id, st)
        self.ends.add(RunningEnd(job_id, st.placement, st.started + st.request.time_limit))

    def pop(self, job_id: str, *default):
        self.ends.discard(job_id)
        return super().pop(job_id, *default)

    def __delitem__(self, job_id: str) -> None:
        self.ends.discard(job_id)
        super().__delitem__(job_id)


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
             quotas: Mapping[str, QueueSpec] | None = None, min_runtime_s: float = 600.0,
             borrower_preempts: bool = False,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    rng = random.Random(seed)
    if progress is not None:  # once per count: a preempted gang's teardown ends like a finish but counts no job
        report_progress, reported = progress, [-1]

        def progress(done: int, of: int) -> None:
            if done != reported[0]:
                reported[0] = done
                report_progress(done, of)
    topology = policy in ("topo", "topo-preempt", "topo-mig")
    preempting = policy in PREEMPTING
    grace = checkpoint_cost_s if checkpoint != "none" else 0.0
    preemption_policy = PreemptionPolicy(min_runtime_s=min_runtime_s, grace_period_s=grace)
    cap, tiers, paths = cluster.build(topology)
    total = cluster.nodes * cluster.gpus
    states: dict[str, _State] = {}
    for j in jobs:
        milli = j.gpu_milli if policy == "topo-mig" and j.gpu_milli else 0
        request = GangRequest(j.job_id, j.replicas, j.gpus_per_replica, int(getattr(j, "priority", 0) or 0),
                              j.submit_s, gpu_milli=milli,
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
    running: dict[str, _State] = _Running()
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
    evicting: dict[str, str] = {}  # victim -> the gang it makes way for, during its checkpoint grace
    handover: list[str] = []  # preemptors whose victims are all gone: placed first in the next pass
    no_preemption: list = [None]  # (signature, valid until): a blocked head's search that found no victims
    preemptions = reclaims = 0
    preempt_lost = 0.0  # GPU-seconds: the victims' checkpoint graces and rolled-back work
    peak_running = 0
    last_finish = 0.0

    def tenant_of(st: _State) -> str:
        return getattr(st.job, "tenant", "") or DEFAULT_QUEUE

    # Fairness against quotas, integrated over time: per tenant, the GPUs it holds and the GPUs it wants (its
    # arrived, unfinished jobs, running or not); its entitlement is the weighted max-min share of the cluster over
    # what the tenants want, weighted by quota (see `_entitlement`).
    fair_tenants = sorted({tenant_of(s) for s in states.values()})
    fair_weight = _quota_weights(fair_tenants, quotas)
    arrivals = sorted((s.job.submit_s, tenant_of(s), demand(s.request)[0]) for s in states.values())
    fair = {"next": 0, "at": 0.0, "hold": dict.fromkeys(fair_tenants, 0.0), "want": dict.fromkeys(fair_tenants, 0.0),
            "got": dict.fromkeys(fair_tenants, 0.0), "entitled": dict.fromkeys(fair_tenants, 0.0),
            "got_s": dict.fromkeys(fair_tenants, 0.0), "entitled_s": dict.fromkeys(fair_tenants, 0.0)}

    def fair_account() -> None:
        """Integrate what each tenant held and was entitled to since the last pass (constant in between)."""
        dt = now - fair["at"]
        if dt > 0:
            for name in fair_tenants:
                fair["got_s"][name] += fair["got"][name] * dt
                fair["entitled_s"][name] += fair["entitled"][name] * dt
        fair["at"] = now
        i = fair["next"]
        while i < len(arrivals) and arrivals[i][0] <= now:
            fair["want"][arrivals[i][1]] += arrivals[i][2]
            i += 1
        fair["next"] = i

    def fair_snapshot() -> None:
        fair["got"] = dict(fair["hold"])
        fair["entitled"] = _entitlement(fair["want"], fair_weight, float(total))

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
        nonlocal allocated, within_leaf, multi_node, leaves_crossed, peak_running
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
        peak_running = max(peak_running, len(running))
        fair["hold"][tenant_of(st)] += held(st)
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
        nonlocal allocated, done, preemptions, reclaims, preempt_lost, last_finish
        advance(st)
        allocated -= held(st)
        fair["hold"][tenant_of(st)] -= held(st)
        cap.release_placement(st.placement)
        a = st.attempts[-1]
        if finished and st.evict_by:
            # The end of a preempted gang's grace (its "finish" event): torn down, requeued with the work left.
            # With checkpointing it keeps everything done until it was asked (the checkpoint was taken then).
            if checkpoint != "none":
                st.remaining_s = max(0.0, st.remaining_s - useful_work(st))
                kept_until, rolled_back = st.evict_at, 0.0
            else:
                kept_until, rolled_back = None, st.evict_at - a.running_at
            st.attempts[-1] = AttemptTimes(a.attempt, a.gpus, a.reserved_at, a.running_at, now, "PREEMPTED",
                                           kept_until=kept_until)
            preemptions += 1
            reclaims += st.evict_reclaim
            st.preempted += 1
            preempt_lost += held(st) * (now - st.evict_at + rolled_back)
            pending[st.job.job_id] = st
        elif finished:
            st.attempts[-1] = AttemptTimes(a.attempt, a.gpus, a.reserved_at, a.running_at, now, "SUCCEEDED")
            st.finish = last_finish = now
            done += 1
            fair["want"][tenant_of(st)] -= demand(st.request)[0]
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
        head = evicting.pop(st.job.job_id, None)
        if head is not None and finished and head not in evicting.values():
            handover.append(head)
        st.evict_by, st.evict_reclaim = "", False
        running.pop(st.job.job_id, None)
        if net is not None and st.job.job_id in net:
            settle(net.remove(st.job.job_id))

    def useful_work(st: _State) -> float:
        """The full-speed seconds of the job's own work done in this attempt (its periodic checkpoint writes left
        out)."""
        interval = interval_of.get(st.job.job_id) if checkpoint == "young-daly" and node_rate > 0 else None
        if not interval:
            return st.attempt_work
        cycles = math.floor(st.attempt_work / (interval + checkpoint_cost_s))
        return cycles * interval + min(st.attempt_work - cycles * (interval + checkpoint_cost_s), interval)

    def evict(st: _State, head: str, reclaim: bool) -> None:
        """Ask a victim to checkpoint: it stops making progress now and is torn down when its grace ends."""
        advance(st)
        st.rate = 0.0
        st.evict_by, st.evict_at, st.evict_reclaim = head, now, reclaim
        evicting[st.job.job_id] = head
        if net is not None and st.job.job_id in net:
            settle(net.remove(st.job.job_id))
        st.end_seq = push(now + grace, "finish", st.job.job_id)

    def hand_over(book: QuotaBook | None) -> None:
        """The handover: a preemptor whose victims are all torn down is placed first, on the GPUs they freed (the
        cycle's atomic handover), ahead of requeued victims that outrank it (a quota reclaim)."""
        heads, handover[:] = list(dict.fromkeys(handover)), []
        for head_id in heads:
            st = pending.get(head_id)
            if st is None:
                continue
            queue = tenant_of(st)
            admitted = book.admit(queue, st.request) if book is not None else None
            if admitted is not None and not isinstance(admitted, list):
                continue  # its quota no longer admits it: it waits its turn
            for a in admitted if admitted is not None else [None]:
                got = place_gang(cap, a.request if a is not None else st.request, tiers)
                if isinstance(got, Placement):
                    cap.reserve(got)
                    if a is not None:
                        book.charge(queue, a.flavor, a.request)
                        st.flavor = a.flavor
                    start(st, got)
                    break

    def preempt_for(head: _State, book: QuotaBook | None) -> None:
        """The blocked head of the queue: evict lower-priority gangs (and, with quotas, gangs running on quota their
        cohort borrowed) when that makes it fit, as the scheduler's cycle does (`preempt_for` there)."""
        head_id = head.job.job_id
        if head_id in evicting.values():
            return  # its victims are checkpointing; it starts at the handover
        priority = head.request.priority
        reclaim: set[str] = set()
        own_queue_only = False
        if book is not None:
            queue = tenant_of(head)
            spec = book.spec(queue)
            admitted = book.admit(queue, head.request)
            nominal = isinstance(admitted, list) and any(not a.borrowing for a in admitted)
            if spec.cohort and nominal:
                reclaim = {s.job.job_id for s in running.values()
                           if not s.evict_by and tenant_of(s) != queue and book.spec(tenant_of(s)).cohort == spec.cohort
                           and book.borrowing(tenant_of(s), s.flavor)}
            own_queue_only = not borrower_preempts and not nominal and not spec.unlimited
        effective = {}
        for s in running.values():
            if not s.evict_by and not (own_queue_only and tenant_of(s) != tenant_of(head)):
                p = s.request.priority
                effective[s.job.job_id] = min(p, priority - 1) if s.job.job_id in reclaim else p
        lower = [running[j] for j, p in effective.items() if p < priority]
        if not lower:
            return
        signature = (head_id, priority, frozenset((s.job.job_id, len(s.attempts)) for s in lower), cap.free_gpus(),
                     frozenset(down))
        memo_np = no_preemption[0]
        if memo_np is not None and memo_np[0] == signature and now < memo_np[1]:
            return
        gangs = [RunningGang(s.job.job_id, effective[s.job.job_id], s.placement, s.started,
                             held(s) * max(0.0, now - s.started)) for s in lower]
        result = choose_victims(cap, head.request, gangs, now, preemption_policy, tiers)
        if isinstance(result, NoPreemption):
            until = now + result.retry_in if result.retry_in is not None else math.inf
            no_preemption[0] = (signature, until)
            if until != math.inf:
                push(until, "wake", head_id)  # look again when the protection ends (the cycle's wake_at)
            return
        no_preemption[0] = None
        for victim in result.victims:
            st = running[victim]
            evict(st, head_id, victim in reclaim and st.request.priority >= priority)

    def schedule() -> None:
        nonlocal passes
        passes += 1
        fair_account()
        try:
            place_pending()
        finally:
            fair_snapshot()

    def place_pending() -> None:
        nonlocal deadlocked
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
        hand_over(book)
        result = schedule_with_backfill(
            cap, [s.request for s in pending.values()], tiers, now=now,
            running=lambda: running.ends,
            backfill=policy != "gang-fifo" and not evicting, depth=depth, book=book, memo=memo,
            queues={s.job.job_id: tenant_of(s) for s in pending.values()} if book else None)
        for placement in result.placements:
            st = pending[placement.job_id]
            st.flavor = result.flavors.get(placement.job_id, "")
            start(st, placement)
        if preempting and result.blocked is not None and result.blocked.job_id in pending:
            preempt_for(pending[result.blocked.job_id], book)

    while events:
        # A finish event superseded by a speed change (or a teardown) is dropped before the clock moves to it.
        top = events[0]
        if top[2] == "finish" and (top[3] not in running or running[top[3]].end_seq != top[1]):
            heapq.heappop(events)
            continue
        t = events[0][0]
        waiting = bool(pending)
        # Only the per-container policy leaves gangs partly placed: the others never hold GPUs while they wait.
        hoard = sum(held(s) for s in pending.values() if s.partial) if policy == "pod" else 0
        free = total - allocated - hoard
        area_alloc += allocated * (t - last)
        if waiting:
            area_idle_waiting += max(0.0, free) * (t - last)
        area_hoard += hoard * (t - last)
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
    # Once every job is done, the makespan ends with the last one (not with a later no-op event, such as a wake-up
    # for a preemption that was no longer needed).
    makespan = max(last_finish if states and done == len(states) else now, 1e-9)
    now = makespan
    fair_account()  # up to the end (a replay that stopped early has not integrated its last interval)
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
        "preemptions": preemptions, "reclaims": reclaims, "preempt_lost_gpu_hours": preempt_lost / 3600,
        "peak_running_jobs": peak_running,
        "events_per_s": (len(states) * 2 + passes) / max(time.perf_counter() - started_wall, 1e-9),
        "wall_s": time.perf_counter() - started_wall,
    }
    # Per tenant: what each got, against its quota's share of the cluster (quotas on) or an equal share.
    tenants: dict[str, dict[str, Any]] = {}
    for s in states.values():
        t = tenants.setdefault(tenant_of(s), {"jobs": 0, "completed": 0, "gpu_hours": 0.0, "jct": [], "wait": [],
                                              "preempted": 0})
        t["jobs"] += 1
        t["preempted"] += s.preempted
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
    # Fairness against the quotas: what each tenant held over the run (GPU-hours received) against its entitlement
    # (at every moment, its quota's weighted max-min share of the cluster over what the tenants wanted then), and
    # Jain's index over those ratios (1: every tenant got the same fraction of its entitlement).
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
    return SimResult(policy, metrics, timeline, jct)


def _quota_weights(tenants: Sequence[str], quotas: Mapping[str, QueueSpec] | None) -> dict[str, float]:
    """Each tenant's share of the quotas' nominal GPUs (no quotas: equal shares), as in the per-tenant metrics."""
    nominal = {n: sum(q.gpus for q in spec.quotas.values()) for n, spec in (quotas or {}).items()}
    all_nominal = sum(nominal.values())
    if not all_nominal:
        return {t: 1 / len(tenants) for t in tenants}
    return {t: nominal.get(t, 0.0) / all_nominal for t in tenants}


def _entitlement(want: Mapping[str, float], weight: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares (water-filling) of `capacity` GPUs: each tenant gets capacity in proportion to
    its weight, never more than it wants; what one does not want goes to the others, again by weight."""
    out = dict.fromkeys(want, 0.0)
    # Water-filling in one sweep: tenants in order of want per weight; each either wants less than the common level
    # (and gets it all) or gets the level times its weight.
    order = sorted((want[t] / weight[t], t) for t in want if want[t] > 1e-9 and weight.get(t, 0.0) > 0)
    left, wsum = capacity, sum(weight[t] for _, t in order)
    for ratio, t in order:
        if left <= 1e-9 or wsum <= 0:
            break
        give = min(want[t], left / wsum * weight[t]) if ratio * wsum > left else want[t]
        out[t] = give
        left -= give
        wsum -= weight[t]
    return out


def _jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all are equal, 1/n at worst."""
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if values and square > 0 else float("nan")


def equal_quotas(jobs: Sequence[Job], total_gpus: int, cohort: str = "all") -> dict[str, QueueSpec]:
    """One queue per tenant with an equal share of the cluster as its nominal quota, all in one cohort (idle quota is
    lent, and reclaimed when its owner needs it)."""
    tenants = sorted({getattr(j, "tenant", "") or DEFAULT_QUEUE for j in jobs})
    share = total_gpus / max(1, len(tenants))
    return {t: QueueSpec(t, {"*": FlavorQuota(gpus=share)}, cohort=cohort) for t in tenants}
