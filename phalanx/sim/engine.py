"""A discrete-event replay of a job trace through the scheduler's own decision (no copy of it, no stand-in).

Every scheduling pass is `phalanx.core.decide.decide`, the very function the scheduler's cycle calls, on a snapshot
of the virtual cluster (its `phalanx.core.capacity.ClusterCapacity`, the running gangs, the pending queue and the
quotas); its plan is then applied to the virtual cluster (`_Replay.apply`) and the virtual clock moves to the next
event. Policies:

- `pod` (a): per-container, no gang semantics, as a stock Kubernetes scheduler: replicas are placed one by one as
  they fit (the pods of every waiting gang compete, one each per round), a gang starts once all are placed, and a
  partly placed gang holds its GPUs meanwhile (hoarding). When no replica can be placed and nothing runs, the
  cluster is deadlocked (the result says since when); the replay goes on with what still fits. (The baseline the
  others are measured against: not the scheduler's policy, so not `decide`.)
- `gang-fifo` (b): whole gangs, strict priority/FIFO order (`decide` with backfill off).
- `gang-backfill` (c): whole gangs with EASY backfill, placed without topology (every node alike).
- `topo` (d): (c) with topology-aware placement (the fabric's leaves and spines).
- `topo-preempt` (e): (d) with preemption and checkpoint-restart (below).
- `topo-mig` (f): (e), and jobs asking for part of a GPU get a share (`gpu_milli`) instead of a whole GPU.
Every gang policy serves the queue in priority order (a job's `priority`, default 0), then submission.
Declared time limits (for backfill) are twice a job's duration. A job's run time is its trace duration times the
slowdown its placement costs (`speed`, default 1: the network model plugs in there).

Failures (`failures_per_gpu_day`, exponential per node): a failed node is out for `repair_s`; every gang on it is
torn down and requeued. With checkpointing (`checkpoint="young-daly"`) it restarts from its last checkpoint (taken
every Young/Daly interval, each costing `checkpoint_cost_s`), otherwise from scratch. The interval is planned for
`planned_failures_per_gpu_day` (default: the failure rate itself, so no periodic checkpoints without failures; set
it to checkpoint periodically in a replay without failures) and capped at `max_checkpoint_interval_s`.

Preemption (`topo-preempt`, `topo-mig`) is the cycle's, because it is `decide`'s: when the head of the queue is
blocked, whole running gangs of strictly lower priority that have run at least `min_runtime_s` are candidates, and
the minimal set whose release makes the head fit is chosen (`phalanx.core.preemption.choose_victims`). With quotas,
a head within its queue's nominal quota may also evict gangs of other queues of its cohort that run on borrowed
quota, whatever their priority (reclaim). A victim is asked to checkpoint (`AskCheckpoint`, its deadline
`checkpoint_cost_s` away): it stops making progress at that moment, keeps all the work done so far, writes the
checkpoint while still holding its GPUs (the grace), and at the deadline the decision stops it (`Stop`) and
requeues it with its remaining work (goodput outcome "PREEMPTED"; the grace counts as rollback); the preemptor is
placed first, on the GPUs its victims freed (the cycle's atomic handover). With `checkpoint="none"` a victim is
stopped at once, in the same decision, and loses its attempt's work. While a preemption is under way nothing is
backfilled. A victim whose preemptor no longer waits (it found room elsewhere meanwhile) is called off (`CallOff`)
and goes on running. `checkpoint_on_preempt=False` (with periodic checkpoints) drops the handshake: a victim is
stopped at once and keeps only what its last periodic checkpoint saved, as after a failure. A head that would run
on borrowed quota may preempt only its own queue's gangs (Kueue's `borrowWithinCohort: Never`);
`borrower_preempts=True` lets it preempt any queue's lower-priority gangs, and then a gang larger than its queue's
quota (always borrowing) and the queues reclaiming from it evict each other in turn, each after `min_runtime_s`
(6,643 preemptions against 12 on a 2,000-job multi-tenant mix).
Metrics: `preemptions` (victims torn down), `reclaims` (of them, evicted for quota reclaim),
`preempt_lost_gpu_hours` (the victims' checkpoint grace plus any work rolled back).

Where the code lives (every name stays importable from here): the replay itself (`simulate`, `_Replay`) here; the
cluster's shape in `phalanx.sim.cluster`; the fairness helpers in `phalanx.sim.fairness`; the metrics of a finished
replay in `phalanx.sim.metrics`.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.core.backfill import RunningEnd, RunningSet
from phalanx.core.checkpoint_policy import young_daly_interval
from phalanx.core.claims import Claim
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
    WakeAt,
    decide,
)
from phalanx.core.goodput import AttemptTimes
from phalanx.core.model import GangRequest, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.core.preemption import PreemptionPolicy
from phalanx.core.quota import QueueSpec, demand

# The cluster's shape, the fairness helpers and the metrics have their own modules; their names stay importable
# from here (the noqa: re-exports).
from .cluster import ClusterSpec, Job
from .fairness import _entitlement, _jain, _quota_weights, _tenant, equal_quotas  # noqa: F401
from .metrics import SimResult, replay_result
from .network import NetJob, NetworkSpec, NetworkState, allreduce_time

# Gradient bytes AllReduced per step when the trace does not say: a 1B-parameter model in bf16.
DEFAULT_MESSAGE_BYTES = 2e9

POLICIES = ("pod", "gang-fifo", "gang-backfill", "topo", "topo-preempt", "topo-mig")
PREEMPTING = ("topo-preempt", "topo-mig")


@dataclass
class _State:
    job: Any
    request: GangRequest
    remaining_s: float  # work left at full speed
    queued: PendingJob  # the job as the decision sees it while it waits
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

    @property
    def placed(self) -> Placement:
        """The placement of a gang that runs (set from `start` to `stop`)."""
        if self.placement is None:
            raise RuntimeError(f"job {self.job.job_id} has no placement: it is not running")
        return self.placement

    preempted: int = 0  # times it was preempted


class _Running(dict):
    """The running gangs by id, and the same gangs in end order (`ends`, a `RunningSet`) for the scheduling pass,
    kept as they start and stop: a pass with a blocked head then neither lists nor sorts them. `views`: the same
    gangs as the decision sees them (`decide.RunningJob`), kept alike."""

    def __init__(self) -> None:
        super().__init__()
        self.ends = RunningSet()
        self.views: dict[str, RunningJob] = {}

    def __setitem__(self, job_id: str, st: _State) -> None:
        super().__setitem__(job_id, st)
        self.ends.add(RunningEnd(job_id, st.placed, st.started + st.request.time_limit))

    def pop(self, job_id: str, *default):
        self.ends.discard(job_id)
        self.views.pop(job_id, None)
        return super().pop(job_id, *default)

    def __delitem__(self, job_id: str) -> None:
        self.ends.discard(job_id)
        self.views.pop(job_id, None)
        super().__delitem__(job_id)


def simulate(
    jobs: Sequence[Job],
    cluster: ClusterSpec,
    policy: str,
    *,
    failures_per_gpu_day: float = 0.0,
    checkpoint: str = "young-daly",
    checkpoint_cost_s: float = 60.0,
    repair_s: float = 3600.0,
    seed: int = 0,
    speed: Callable[[Job, Placement], float] | None = None,
    depth: int = 200,
    network: NetworkSpec | None = None,
    comm_fraction: float = 0.2,
    quotas: Mapping[str, QueueSpec] | None = None,
    min_runtime_s: float = 600.0,
    borrower_preempts: bool = False,
    progress: Callable[[int, int], None] | None = None,
    checkpoint_on_preempt: bool = True,
    planned_failures_per_gpu_day: float | None = None,
    max_checkpoint_interval_s: float = math.inf,
) -> SimResult:
    """Replay `jobs` on `cluster` under `policy`: events in time order, and after each instant one scheduling pass
    (snapshot -> `decide` -> the plan applied to the virtual cluster); then the metrics."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
    replay = _Replay(
        jobs,
        cluster,
        policy,
        failures_per_gpu_day=failures_per_gpu_day,
        checkpoint=checkpoint,
        checkpoint_cost_s=checkpoint_cost_s,
        repair_s=repair_s,
        seed=seed,
        speed=speed,
        depth=depth,
        network=network,
        comm_fraction=comm_fraction,
        quotas=quotas,
        min_runtime_s=min_runtime_s,
        borrower_preempts=borrower_preempts,
        progress=progress,
        checkpoint_on_preempt=checkpoint_on_preempt,
        planned_failures_per_gpu_day=planned_failures_per_gpu_day,
        max_checkpoint_interval_s=max_checkpoint_interval_s,
    )
    replay.run()
    return replay.result()


class _Replay:
    """One replay: the virtual cluster (capacity index, running and pending gangs, failed nodes), the event queue
    and the virtual clock, and what the metrics integrate along the way."""

    def __init__(
        self,
        jobs: Sequence[Job],
        cluster: ClusterSpec,
        policy: str,
        *,
        failures_per_gpu_day: float,
        checkpoint: str,
        checkpoint_cost_s: float,
        repair_s: float,
        seed: int,
        speed: Callable[[Job, Placement], float] | None,
        depth: int,
        network: NetworkSpec | None,
        comm_fraction: float,
        quotas: Mapping[str, QueueSpec] | None,
        min_runtime_s: float,
        borrower_preempts: bool,
        progress: Callable[[int, int], None] | None,
        checkpoint_on_preempt: bool = True,
        planned_failures_per_gpu_day: float | None = None,
        max_checkpoint_interval_s: float = math.inf,
    ) -> None:
        self.policy, self.checkpoint, self.checkpoint_cost_s = policy, checkpoint, checkpoint_cost_s
        self.repair_s, self.speed, self.network, self.comm_fraction = repair_s, speed, network, comm_fraction
        self.quotas = quotas
        self.rng = random.Random(seed)
        self._progress = progress
        self._reported = -1  # once per count: a preempted gang's teardown ends like a finish but counts no job
        topology = policy in ("topo", "topo-preempt", "topo-mig")
        self.cap, self.tiers, self.paths = cluster.build(topology)
        # No handshake (no checkpointing at all, or victims stopped at once): a zero grace period, and the decision
        # stops the victims in the same plan that asks them.
        self.handshake = checkpoint != "none" and checkpoint_on_preempt
        grace = checkpoint_cost_s if self.handshake else 0.0
        preemption = PreemptionPolicy(min_runtime_s=min_runtime_s, grace_period_s=grace)
        self.config = DecideConfig(
            tiers=self.tiers,
            backfill=policy != "gang-fifo",
            depth=depth,
            preemption=preemption if policy in PREEMPTING else None,
            borrower_preempts=borrower_preempts,
            # No time budget: a replay is a function of its inputs alone, whatever the machine or its load (the
            # deterministic work bound of the exact search still holds); the scheduler differs only where its
            # budget stops a search, and its placement reason says so.
            placement_budget_ms=0.0,
        )
        self.cap.placement_budget_ms = 0.0  # for the per-pod baseline's own place_gang calls too
        self.total = cluster.nodes * cluster.gpus
        self.totals = {"gpus": float(self.total)}
        self.states: dict[str, _State] = {}
        for j in jobs:
            milli = j.gpu_milli if policy == "topo-mig" and j.gpu_milli else 0
            request = GangRequest(
                j.job_id,
                j.replicas,
                j.gpus_per_replica,
                int(getattr(j, "priority", 0) or 0),
                j.submit_s,
                gpu_milli=milli,
                time_limit=2 * max(j.duration_s, 1.0),
            )
            self.states[j.job_id] = _State(j, request, j.duration_s, PendingJob(request, _tenant(j)))
        self.events: list[tuple[float, int, str, str]] = []
        self.seq = 0
        for j in jobs:
            self.push(j.submit_s, "arrive", j.job_id)
        self.node_rate = failures_per_gpu_day * cluster.gpus / 86400.0
        # Periodic checkpoints: the Young/Daly interval for this per-node rate, capped (0: none).
        planned = failures_per_gpu_day if planned_failures_per_gpu_day is None else planned_failures_per_gpu_day
        self.plan_rate = planned * cluster.gpus / 86400.0
        self.max_interval = max_checkpoint_interval_s
        if self.node_rate > 0:
            for n in self.cap.nodes:
                self.push(self.rng.expovariate(self.node_rate), "fail", n)
        self.pending: dict[str, _State] = {}
        self.running = _Running()
        self.down: set[str] = set()
        self.now = self.last = 0.0
        self.allocated = 0.0
        self.area_alloc = self.area_idle_waiting = self.area_hoard = 0.0
        self.timeline: list[tuple[float, float]] = []
        self.done = 0
        self.deadlocked: float | bool = False
        self.started_wall = time.perf_counter()
        self.passes = 0
        self.within_leaf = self.multi_node = self.leaves_crossed = 0
        self.interval_of: dict[str, float] = {}
        self.net = NetworkState(cluster.fabric(), network) if network is not None else None
        self.memo = Memo()  # the decision's memo (the head's reservation, a "no victims" answer), across passes
        self.cross_spine_bytes = 0.0
        self.evicting: dict[str, str] = {}  # victim -> the gang it makes way for, during its checkpoint grace
        self.claims: dict[str, Claim] = {}  # preemptor -> its claim on what its victims free (SetClaim/EndClaim)
        self.wakes: set[float] = set()  # wake-ups pushed and not yet reached
        self.preemptions = self.reclaims = 0
        self.preempt_lost = 0.0  # GPU-seconds: the victims' checkpoint graces and rolled-back work
        self.peak_running = 0
        self.last_finish = 0.0
        # Fairness against quotas, integrated over time: per tenant, the GPUs it holds and the GPUs it wants (its
        # arrived, unfinished jobs, running or not); its entitlement is the weighted max-min share of the cluster
        # over what the tenants want, weighted by quota (see `_entitlement`).
        self.fair_tenants = sorted({_tenant(s.job) for s in self.states.values()})
        self.fair_weight = _quota_weights(self.fair_tenants, quotas)
        self.arrivals = sorted((s.job.submit_s, _tenant(s.job), demand(s.request)[0]) for s in self.states.values())
        zero = dict.fromkeys(self.fair_tenants, 0.0)
        self.fair: dict[str, Any] = {
            "next": 0,
            "at": 0.0,
            "hold": dict(zero),
            "want": dict(zero),
            "got": dict(zero),
            "entitled": dict(zero),
            "got_s": dict(zero),
            "entitled_s": dict(zero),
        }

    # ---- the event loop ------------------------------------------------------------------------------------------

    def push(self, t: float, kind: str, key: str) -> int:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, key))
        return self.seq

    def run(self) -> None:
        """Events in time order; after each instant's events, one scheduling pass."""
        events = self.events
        while events:
            # A finish event superseded by a speed change (or a teardown) is dropped before the clock moves to it.
            top = events[0]
            if top[2] == "finish" and (top[3] not in self.running or self.running[top[3]].end_seq != top[1]):
                heapq.heappop(events)
                continue
            t = events[0][0]
            self.advance_clock(t)
            while events and events[0][0] == t:
                _, ev_seq, kind, key = heapq.heappop(events)
                self.handle(kind, key, ev_seq)
            if self.node_rate > 0 and not self.pending and not self.running and self.done == len(self.states):
                break
            self.schedule()
            if not self.timeline or self.now - self.timeline[-1][0] >= 60.0:
                self.timeline.append((self.now, self.allocated / self.total))

    def advance_clock(self, t: float) -> None:
        """Integrate the areas up to `t` and move the virtual clock there."""
        waiting = bool(self.pending)
        # Only the per-container policy leaves gangs partly placed: the others never hold GPUs while they wait.
        hoard = sum(self.held(s) for s in self.pending.values() if s.partial) if self.policy == "pod" else 0
        free = self.total - self.allocated - hoard
        self.area_alloc += self.allocated * (t - self.last)
        if waiting:
            self.area_idle_waiting += max(0.0, free) * (t - self.last)
        self.area_hoard += hoard * (t - self.last)
        self.now = self.last = t

    def handle(self, kind: str, key: str, ev_seq: int) -> None:
        if kind == "arrive":
            self.pending[key] = self.states[key]
        elif kind == "finish":
            st = self.running.get(key)
            if st is not None and st.end_seq == ev_seq:
                self.stop(st, finished=True)
                if self._progress is not None and self.done % 500 == 0:
                    self.report_progress()
        elif kind == "fail":
            if key not in self.down:
                self.down.add(key)
                self.cap.set_schedulable(key, False)
                for st in [s for s in self.running.values() if key in s.placement.nodes]:
                    self.stop(st, finished=False)
                self.push(self.now + self.repair_s, "repair", key)
        elif kind == "repair":
            self.down.discard(key)
            self.cap.set_schedulable(key, True)
            self.push(self.now + self.rng.expovariate(self.node_rate), "fail", key)
        elif kind == "wake":
            self.wakes.discard(self.now)

    def report_progress(self) -> None:
        if self._progress is not None and self.done != self._reported:
            self._reported = self.done
            self._progress(self.done, len(self.states))

    # ---- one scheduling pass: snapshot -> decide -> apply ------------------------------------------------------

    def schedule(self) -> None:
        self.passes += 1
        self.fair_account()
        try:
            if self.policy == "pod":
                self.pod_pass()
            else:
                self.apply(decide(self.snapshot(), self.now))
        finally:
            self.fair_snapshot()

    def snapshot(self) -> Snapshot:
        """The virtual cluster as the decision sees it (the same index, kept up to date: no copy)."""
        return Snapshot(
            capacity=self.cap,
            pending=[s.queued for s in self.pending.values()],
            running=self.running.views,
            config=self.config,
            queues=self.quotas or {},
            totals=self.totals,
            ends=self._ends,
            preempting=self.evicting.keys(),
            memo=self.memo,
            claims=self.claims,
        )

    def _ends(self) -> Sequence[RunningEnd] | RunningSet:
        return self.running.ends

    def apply(self, plan: Plan) -> None:
        """The plan on the virtual cluster (its capacity index holds the plan already)."""
        for step in plan:
            if isinstance(step, Reserve):
                st = self.pending[step.job]
                st.flavor = step.flavor
                self.start(st, step.placement)
            elif isinstance(step, AskCheckpoint):
                self.evict(self.running[step.job], step.by, step.deadline, step.reclaim)
            elif isinstance(step, Stop):
                self.stop(self.running[step.job], finished=True, released=True)
            elif isinstance(step, CallOff):
                self.resume(self.running[step.job])
            elif isinstance(step, SetClaim):
                self.claims[step.claim.job] = step.claim
            elif isinstance(step, EndClaim):
                self.claims.pop(step.job, None)
            elif isinstance(step, WakeAt) and step.t not in self.wakes:
                self.wakes.add(step.t)
                self.push(step.t, "wake", "")

    def pod_pass(self) -> None:
        """Per-container (a): pods of every waiting gang compete, one replica each per round (as a per-pod
        scheduler sees them), until no replica fits: partly placed gangs keep what they got. Not the scheduler's
        policy (no `decide`): the baseline it is measured against."""
        progress_made = False
        order = sorted(self.pending.values(), key=lambda s: (s.request.submitted_at, s.job.job_id))
        placed_one = True
        while placed_one:
            placed_one = False
            for st in order:
                r = st.request
                if st.placement is not None or len(st.partial) >= r.replicas:
                    continue
                one = GangRequest(f"{r.job_id}/{len(st.partial)}", 1, r.gpus_per_replica)
                got = place_gang(self.cap, one, self.tiers)
                if isinstance(got, Placement):
                    self.cap.reserve(got)
                    st.partial.append(got)
                    placed_one = progress_made = True
        for st in order:
            r = st.request
            if st.placement is None and len(st.partial) == r.replicas:
                reps = tuple(
                    ReplicaPlacement(i, p.replicas[0].node, p.replicas[0].gpus) for i, p in enumerate(st.partial)
                )
                st.partial = []
                self.start(st, Placement(r.job_id, reps, "", 0, 0.0, "per-container"))
        if (
            not progress_made
            and not self.running
            and any(s.partial for s in self.pending.values())
            and not self.deadlocked
        ):
            self.deadlocked = self.now  # partly placed gangs hold what the others need: nothing can ever start

    # ---- the virtual cluster's transitions ---------------------------------------------------------------------

    def held(self, st: _State) -> float:
        if st.placement is not None:
            return demand(st.request)[0]
        return len(st.partial) * demand(st.request)[0] / st.request.replicas

    def work_of(self, st: _State, placement: Placement) -> float:
        work = st.remaining_s
        if self.checkpoint == "young-daly" and self.plan_rate > 0:
            nodes = max(1, len(set(placement.nodes)))
            interval = min(self.max_interval, young_daly_interval(self.checkpoint_cost_s, 1 / (self.plan_rate * nodes)))
            self.interval_of[st.job.job_id] = interval
            work += math.floor(work / interval) * self.checkpoint_cost_s
        return work

    def net_job(self, st: _State, placement: Placement) -> NetJob | None:
        """The job's AllReduce per step (gradient bytes) and compute per step, set so that on the best placement
        of its shape (one node: NVLink; else whole rails per node) communication is `comm_fraction` of a step."""
        r, network = st.request, self.network
        ranks = r.replicas * r.gpus_per_replica
        if self.net is None or network is None or ranks < 2 or r.gpu_milli:  # network model off: both None
            return None
        message = float(getattr(st.job, "param_bytes", 0) or DEFAULT_MESSAGE_BYTES)
        best = network.nvlink_bw if r.replicas == 1 else min(network.nvlink_bw, r.gpus_per_replica * network.ib_rail_bw)
        ideal_comm = allreduce_time(message, ranks, best)
        compute = ideal_comm * (1 - self.comm_fraction) / self.comm_fraction
        st.ideal_step = compute + ideal_comm
        return NetJob(placement, message, compute)

    def settle(self, net: NetworkState, changed) -> None:
        """Jobs whose bandwidth changed (in `net`): account the work done at the old speed, go on at the new one."""
        for job_id in changed:
            st = self.running.get(job_id)
            if st is None:
                continue
            self.advance(st)
            st.rate = min(1.0, st.ideal_step / net.step_time(job_id)) if st.ideal_step else 1.0
            st.end_seq = self.push(self.now + st.work_left / st.rate, "finish", job_id)

    def advance(self, st: _State) -> None:
        done_work = (self.now - st.last) * st.rate
        st.work_left -= done_work
        st.attempt_work += done_work
        if self.net is not None and st.ideal_step and st.job.job_id in self.net:
            self.cross_spine_bytes += self.net.cross_spine_bytes(st.job.job_id) * done_work / st.ideal_step
        st.last = self.now

    def _run_at_speed(self, st: _State, placement: Placement) -> None:
        """Run (or go on running) at the speed its placement and the network give it; push its finish."""
        slow = self.speed(st.job, placement) if self.speed else 1.0
        st.rate = 1.0 / slow if slow > 0 else 1.0
        job = self.net_job(st, placement)
        if job is not None and self.net is not None:  # net_job gives a job only with the network model on
            self.settle(self.net, self.net.add(job))
        else:
            st.end_seq = self.push(self.now + st.work_left / st.rate, "finish", st.job.job_id)

    def start(self, st: _State, placement: Placement) -> None:
        now = self.now
        st.placement = placement
        st.started = st.last = now
        if st.first_start is None:
            st.first_start = now
        st.attempts.append(AttemptTimes(len(st.attempts) + 1, self.held(st), now, now))
        self.allocated += self.held(st)
        st.work_left, st.attempt_work, st.ideal_step = self.work_of(st, placement), 0.0, 0.0
        self.running[st.job.job_id] = st
        self.running.views[st.job.job_id] = self._view(st)
        self.peak_running = max(self.peak_running, len(self.running))
        self.fair["hold"][_tenant(st.job)] += self.held(st)
        self.pending.pop(st.job.job_id, None)
        self._run_at_speed(st, placement)
        nodes = set(placement.nodes)
        if len(nodes) > 1:
            self.multi_node += 1
            leaves = {self.paths[n][0] for n in nodes}
            self.within_leaf += len(leaves) == 1
            self.leaves_crossed += len(leaves) - 1

    def _view(self, st: _State, by: str = "", deadline: float = 0.0) -> RunningJob:
        return RunningJob(
            st.request,
            st.placed,
            st.started,
            _tenant(st.job),
            st.flavor,
            len(st.attempts),
            st.started,
            self.held(st),
            by,
            deadline,
        )

    def stop(self, st: _State, *, finished: bool, released: bool = False) -> None:
        """End the gang's attempt: finished, its preemption's grace over (`evict_by` set: requeued with the work
        left), or torn down by a failure. `released`: the decision gave its GPUs back in the index already."""
        now = self.now
        self.advance(st)
        self.allocated -= self.held(st)
        self.fair["hold"][_tenant(st.job)] -= self.held(st)
        if not released:
            self.cap.release_placement(st.placed)
        a = st.attempts[-1]
        ran_from = st.started  # = a.running_at: `start` opens every attempt running
        if finished and st.evict_by:
            # A preempted gang stopped: requeued with the work left. With the handshake it keeps everything done
            # until it was asked (the checkpoint was taken then); without, what its last periodic one saved.
            kept_until: float | None
            if self.handshake:
                st.remaining_s = max(0.0, st.remaining_s - self.useful_work(st))
                kept_until, rolled_back = st.evict_at, 0.0
            else:
                kept, kept_wall = self.periodic_kept(st, st.evict_at - ran_from)
                st.remaining_s = max(0.0, st.remaining_s - kept)
                kept_until = ran_from + kept_wall if kept else None
                rolled_back = st.evict_at - ran_from - kept_wall
            st.attempts[-1] = AttemptTimes(
                a.attempt, a.gpus, a.reserved_at, a.running_at, now, "PREEMPTED", kept_until=kept_until
            )
            self.preemptions += 1
            self.reclaims += st.evict_reclaim
            st.preempted += 1
            self.preempt_lost += self.held(st) * (now - st.evict_at + rolled_back)
            self.pending[st.job.job_id] = st
        elif finished:
            st.attempts[-1] = AttemptTimes(a.attempt, a.gpus, a.reserved_at, a.running_at, now, "SUCCEEDED")
            st.finish = self.last_finish = now
            self.done += 1
            self.fair["want"][_tenant(st.job)] -= demand(st.request)[0]
        else:  # torn down by a failure: keep what the last checkpoint saved
            kept, kept_wall = self.periodic_kept(st, now - ran_from)
            st.remaining_s = max(0.0, st.remaining_s - kept)
            st.attempts[-1] = AttemptTimes(
                a.attempt,
                a.gpus,
                a.reserved_at,
                a.running_at,
                now,
                "NODE_LOST",
                kept_until=ran_from + kept_wall if kept else None,
            )
            self.pending[st.job.job_id] = st
        st.placement = None
        self.evicting.pop(st.job.job_id, None)
        st.evict_by, st.evict_reclaim = "", False
        self.running.pop(st.job.job_id, None)
        if self.net is not None and st.job.job_id in self.net:
            self.settle(self.net, self.net.remove(st.job.job_id))

    def periodic_kept(self, st: _State, wall: float) -> tuple[float, float]:
        """What the attempt's last periodic checkpoint saved: (full-speed seconds of its own work, wall seconds
        into the attempt when that checkpoint began); (0, 0) without periodic checkpoints."""
        interval = self.interval_of.get(st.job.job_id)
        if self.checkpoint != "young-daly" or not interval:
            return 0.0, 0.0
        kept = math.floor(st.attempt_work / (interval + self.checkpoint_cost_s)) * interval
        return kept, (wall * kept / st.attempt_work if st.attempt_work > 0 else 0.0)

    def useful_work(self, st: _State) -> float:
        """The full-speed seconds of the job's own work done in this attempt (its periodic checkpoint writes left
        out)."""
        interval = (
            self.interval_of.get(st.job.job_id) if self.checkpoint == "young-daly" and self.plan_rate > 0 else None
        )
        if not interval:
            return st.attempt_work
        cycle = interval + self.checkpoint_cost_s
        cycles = math.floor(st.attempt_work / cycle)
        return cycles * interval + min(st.attempt_work - cycles * cycle, interval)

    def evict(self, st: _State, by: str, deadline: float, reclaim: bool) -> None:
        """Asked to checkpoint: it stops making progress now, writes its checkpoint while it holds its GPUs, and
        is stopped at `deadline` (the decision's `Stop`, at the wake-up it asks for)."""
        self.advance(st)
        st.rate = 0.0
        st.evict_by, st.evict_at, st.evict_reclaim = by, self.now, reclaim
        self.evicting[st.job.job_id] = by
        self.running.views[st.job.job_id] = self._view(st, by, deadline)
        if self.net is not None and st.job.job_id in self.net:
            self.settle(self.net, self.net.remove(st.job.job_id))
        st.end_seq = 0  # no finish while it checkpoints

    def resume(self, st: _State) -> None:
        """Its preemption was called off (the preemptor no longer waits): it goes on from where it stopped."""
        self.advance(st)
        st.evict_by, st.evict_reclaim = "", False
        self.evicting.pop(st.job.job_id, None)
        self.running.views[st.job.job_id] = self._view(st)
        self._run_at_speed(st, st.placed)

    # ---- fairness, integrated over time -----------------------------------------------------------------------

    def fair_account(self) -> None:
        """Integrate what each tenant held and was entitled to since the last pass (constant in between)."""
        fair, now = self.fair, self.now
        dt = now - fair["at"]
        if dt > 0:
            for name in self.fair_tenants:
                fair["got_s"][name] += fair["got"][name] * dt
                fair["entitled_s"][name] += fair["entitled"][name] * dt
        fair["at"] = now
        i, arrivals = fair["next"], self.arrivals
        while i < len(arrivals) and arrivals[i][0] <= now:
            fair["want"][arrivals[i][1]] += arrivals[i][2]
            i += 1
        fair["next"] = i

    def fair_snapshot(self) -> None:
        self.fair["got"] = dict(self.fair["hold"])
        self.fair["entitled"] = _entitlement(self.fair["want"], self.fair_weight, float(self.total))

    # ---- the metrics ------------------------------------------------------------------------------------------

    def result(self) -> SimResult:
        return replay_result(self)
