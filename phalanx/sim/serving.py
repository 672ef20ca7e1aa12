"""Serving next to training in the trace replay: an autoscaled inference service whose replicas are gangs, and a
training trace beside it, both placed and preempted by the scheduler's own decision (`phalanx.core.decide`).

The service (:class:`ServingSpec`):

- A replica is a gang of `replica_nodes` whole nodes (default 2 x 8 GPUs) at a priority above every training job
  (1000). It is a pending gang like any other until a decision places it; it counts as ready `startup_s` after
  that (placement, image and weights, warm-up: 600 s by default, an assumption). The fleet at the start is placed
  warm (ready at once).
- Each replica serves `capacity_rps` requests per second within its latency SLO (a unit: the results depend on
  the offered load over it only).
- The autoscaler is `phalanx.core.autoscale.recommend`, the rule the scheduler's service controller calls, run at
  every load bin (60 s): its metric is the offered requests per second per replica (each ready replica reports its
  share of the load, one not yet ready reports 0, as HPA counts pods that are not ready when it scales up), its
  target `target_utilization` x `capacity_rps` (0.7: headroom for bursts and start-up, an assumption), with HPA's
  tolerance (10%) and stabilization windows (none up, 300 s down). Scaling up adds pending replicas; scaling down
  removes the newest replica (a pending one first: they are the newest).

The policies (:data:`SERVING_POLICIES`), each through the same `decide` (a serving pool of `serve_nodes` nodes,
sized by the caller, the rest the training pool; pools are node labels, matched by a gang's `gpu_model`):

- `static-split`: serving runs on its pool only and training on the rest; no preemption at all.
- `preempt`: one shared pool, no labels; a serving replica that does not fit preempts lower-priority (training)
  gangs at once, with no checkpoint handshake (a zero grace period): its victims keep only what their last
  periodic checkpoint saved.
- `preempt-checkpoint-backfill`: long training runs on the training pool; gangs that declare a time limit of at
  most `batch_limit_s` (batch gangs) may run anywhere, so they backfill the serving pool's GPUs that serving does
  not use between its trough and its peak. A serving replica asks for its pool first, and preempts what runs there
  through the checkpoint handshake (asked to checkpoint, stopped at the deadline, `checkpoint_cost_s` later, with
  their work kept); when its pool can give it nothing (no gang there it could preempt), it spills over to the whole
  cluster, where it preempts the same way.

Training checkpoints periodically in every policy: at the Young/Daly interval for the Llama 3 failure rate
(`planned_failures_per_gpu_day`, 4.7e-4 per GPU-day), capped at `max_checkpoint_interval_s` (an hour: an
assumption), each checkpoint costing `checkpoint_cost_s`. No node fails (the planned rate only sets the interval).
Victims are chosen by the decision as in the scheduler: lowest priority, then least work since the last checkpoint.

The metrics (`ServingResult.metrics`, over the window of the load series): for serving, replica-hours (placed),
ready replica-hours, the share of time with enough ready capacity for the offered load (an SLO proxy), the share of
requests offered beyond the ready capacity, and the ready replicas at each day's peak of the envelope; for training,
goodput (productive / allocated GPU-hours, phalanx.core.goodput), the GPU-hours lost to preemption by serving
(checkpoint grace plus rolled-back work), preemptions, mean JCT and queueing delay; the cluster's utilisation.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.core.autoscale import AutoscalePolicy, AutoscaleState, recommend
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.decide import Memo, PendingJob, Plan, Snapshot, Wait
from phalanx.core.goodput import Goodput, account_job
from phalanx.core.model import GangRequest, Placement
from phalanx.core.quota import demand
from phalanx.core.status import Code

from .cluster import ClusterSpec, Job
from .engine import _Replay, _State
from .fairness import _tenant
from .serving_load import DAY_S, LoadSeries, replicas_for

STATIC_SPLIT, PREEMPT, PREEMPT_CHECKPOINT_BACKFILL = "static-split", "preempt", "preempt-checkpoint-backfill"
SERVING_POLICIES = (STATIC_SPLIT, PREEMPT, PREEMPT_CHECKPOINT_BACKFILL)
SERVE_POOL, TRAIN_POOL = "serve", "train"  # node labels (NodeCapacity.gpu_model), matched by GangRequest.gpu_model
SERVING_TENANT = "serving"
LLAMA3_FAILURES_PER_GPU_DAY = 4.7e-4  # 419 unexpected interruptions in 54 days on 16,384 GPUs (the Llama 3 report)


@dataclass(frozen=True)
class ServingSpec:
    """The service: its replicas' shape and capacity, start-up, priority, and the autoscaler's settings."""

    replica_nodes: int = 2
    capacity_rps: float = 10.0
    target_utilization: float = 0.7
    startup_s: float = 600.0
    priority: int = 1000
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0

    @property
    def target_rps(self) -> float:
        """The autoscaler's target: offered requests per second per replica."""
        return self.capacity_rps * self.target_utilization

    def autoscale(self, max_replicas: int) -> AutoscalePolicy:
        policy = AutoscalePolicy(
            min_replicas=1,
            max_replicas=max_replicas,
            metric="offered_requests_per_second",
            target=self.target_rps,
            tolerance=self.tolerance,
            scale_up_window_s=self.scale_up_window_s,
            scale_down_window_s=self.scale_down_window_s,
        )
        problems = policy.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return policy


@dataclass(frozen=True)
class ServingSetup:
    """Everything a run needs besides its policy and its training jobs."""

    cluster: ClusterSpec
    load: LoadSeries
    service: ServingSpec = ServingSpec()
    serve_nodes: int = 0  # the serving pool (0: sized for the load's busiest bin, `pool_for`)
    batch_limit_s: float = 4 * 3600.0  # preempt-checkpoint-backfill: gangs declaring at most this may use the pool
    checkpoint_cost_s: float = 60.0
    min_runtime_s: float = 600.0
    planned_failures_per_gpu_day: float = LLAMA3_FAILURES_PER_GPU_DAY
    max_checkpoint_interval_s: float = 3600.0

    def pool_nodes(self) -> int:
        return self.serve_nodes or pool_for(self.load, self.service)


def pool_for(load: LoadSeries, service: ServingSpec) -> int:
    """The nodes that hold the fleet the autoscaler wants at the load's busiest bin (a static split sized for the
    peak it will actually see: the most generous static split there is)."""
    return service.replica_nodes * replicas_for(float(load.rates.max()), service.target_rps)


@dataclass(frozen=True)
class ReplicaJob:
    """A serving replica as the replay sees a job (the `cluster.Job` fields, plus its priority and tenant)."""

    job_id: str
    submit_s: float
    replicas: int
    gpus_per_replica: int
    priority: int
    warm: bool = False  # part of the fleet at the start: ready as soon as it is placed
    gpu_milli: int = 0
    duration_s: float = math.inf
    tenant: str = SERVING_TENANT


@dataclass
class ServingResult:
    policy: str
    metrics: dict[str, Any]
    # One row per autoscaler step: (time s, offered rps, replicas wanted, ready, placed, training GPUs allocated).
    series: list[tuple[float, float, int, int, int, float]] = field(default_factory=list)


def simulate_serving(jobs: Sequence[Job], setup: ServingSetup, policy: str, seed: int = 0) -> ServingResult:
    """Replay `jobs` (training) beside the service of `setup` under `policy`, over the load series' window."""
    replay = _ServingReplay(jobs, setup, policy, seed)
    replay.run()
    return ServingResult(policy, replay.metrics(), replay.series)


class _LastCheckpoint(Mapping[str, float]):
    """When each running gang's last periodic checkpoint began (`Snapshot.saved_at`), computed on demand: the
    decision reads it only to rank preemption victims by the work they would lose."""

    def __init__(self, replay: _ServingReplay) -> None:
        self.replay = replay

    def __getitem__(self, job_id: str) -> float:
        r = self.replay
        st = r.running.get(job_id)
        interval = r.interval_of.get(job_id) if st is not None else None
        if st is None or not interval:
            raise KeyError(job_id)
        work = st.attempt_work + (r.now - st.last) * st.rate
        cycles = math.floor(work / (interval + r.checkpoint_cost_s))
        if cycles <= 0 or work <= 0:
            raise KeyError(job_id)  # none yet in this attempt: the decision counts from its start
        return st.started + (r.now - st.started) * cycles * (interval + r.checkpoint_cost_s) / work

    def __iter__(self) -> Iterator[str]:
        return iter([j for j in self.replay.running if j in self.replay.interval_of])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _ServingReplay(_Replay):
    """The replay of `engine._Replay` with the service beside the trace: autoscaler steps at every load bin,
    replicas as gangs, pools as node labels, and the serving metrics integrated as the clock moves."""

    def __init__(self, jobs: Sequence[Job], setup: ServingSetup, policy: str, seed: int) -> None:
        if policy not in SERVING_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(SERVING_POLICIES)}")
        pool = setup.pool_nodes()
        if not 0 < pool < setup.cluster.nodes:
            raise ValueError(
                f"the serving pool ({pool} nodes) must leave training some of the {setup.cluster.nodes} nodes"
            )
        # The window: nothing after it is replayed (events past it are dropped, and none at all once it is over).
        self.horizon, self.over = len(setup.load.counts) * setup.load.bin_s, False
        super().__init__(
            jobs,
            setup.cluster,
            "topo" if policy == STATIC_SPLIT else "topo-preempt",
            failures_per_gpu_day=0.0,
            checkpoint="young-daly",
            checkpoint_cost_s=setup.checkpoint_cost_s,
            repair_s=3600.0,
            seed=seed,
            speed=None,
            depth=200,
            network=None,
            comm_fraction=0.2,
            quotas=None,
            min_runtime_s=setup.min_runtime_s,
            borrower_preempts=False,
            progress=None,
            checkpoint_on_preempt=policy == PREEMPT_CHECKPOINT_BACKFILL,
            planned_failures_per_gpu_day=setup.planned_failures_per_gpu_day,
            max_checkpoint_interval_s=setup.max_checkpoint_interval_s,
        )
        self.serving_policy, self.setup, self.load, self.service = policy, setup, setup.load, setup.service
        self.pool_size = pool
        self.pools = policy != PREEMPT
        if self.pools:
            self._label_pools(pool)
            self._confine_training(policy)
        self.replica_gpus = self.service.replica_nodes * setup.cluster.gpus
        self.scaler = self.service.autoscale(max(1, setup.cluster.nodes // self.service.replica_nodes))
        self.scaler_state = AutoscaleState()
        self.fleet: list[_State] = []  # the service's replicas, oldest first
        self.ready: set[str] = set()
        self.made = self.spills = 0
        self.spilled = False
        self.fair["hold"].setdefault(SERVING_TENANT, 0.0)
        self.series: list[tuple[float, float, int, int, int, float]] = []
        self.ready_at_peaks: list[int] = []
        self.row: tuple[float, int] | None = None
        self.placement_delays: list[float] = []  # scale-ups: from the autoscaler's step to the placement
        self.area: dict[str, float] = dict.fromkeys(
            ("ok_s", "offered", "unserved", "replica_s", "ready_s", "serving_gpu_s"), 0.0
        )
        self.push(0.0, "tick", "")
        self.push(self.horizon, "end", "")

    # ---- pools

    def _label_pools(self, pool: int) -> None:
        """The first `pool` nodes (the first leaves) are the serving pool, the rest the training pool."""
        serve = set(sorted(self.cap.nodes)[:pool])
        self.cap = ClusterCapacity(
            dataclasses.replace(n, free=set(n.free), gpu_model=SERVE_POOL if n.name in serve else TRAIN_POOL)
            for n in self.cap.nodes.values()
        )
        self.cap.placement_budget_ms = 0.0

    def _confine_training(self, policy: str) -> None:
        """Training to the training pool: all of it under the static split, the gangs with long time limits under
        preempt-checkpoint-backfill (the batch gangs may go anywhere)."""
        for st in self.states.values():
            long = st.request.time_limit > self.setup.batch_limit_s
            if policy == STATIC_SPLIT or long:
                st.request = dataclasses.replace(st.request, gpu_model=TRAIN_POOL)
                st.queued = PendingJob(st.request, _tenant(st.job))

    # ---- events

    def handle(self, kind: str, key: str, ev_seq: int) -> None:
        if kind == "tick":
            self.autoscale()
        elif kind == "ready":
            if key in self.running:
                self.ready.add(key)
        elif kind == "end":
            self.events.clear()  # the window is over: the replay stops after this instant
            self.over = True
        else:
            super().handle(kind, key, ev_seq)

    def push(self, t: float, kind: str, key: str) -> int:
        if t > self.horizon or self.over:
            self.seq += 1
            return self.seq  # past the window: never replayed
        return super().push(t, kind, key)

    def advance_clock(self, t: float) -> None:
        dt = t - self.last
        if dt > 0:
            load = self.load.rate_at(self.last)  # constant between events: every bin edge is an autoscaler step
            capacity = len(self.ready) * self.service.capacity_rps
            placed = sum(1 for st in self.fleet if st.placement is not None)
            a = self.area
            a["ok_s"] += dt if capacity >= load else 0.0
            a["offered"] += load * dt
            a["unserved"] += max(0.0, load - capacity) * dt
            a["replica_s"] += placed * dt
            a["ready_s"] += len(self.ready) * dt
            a["serving_gpu_s"] += placed * self.replica_gpus * dt
        super().advance_clock(t)

    # ---- the autoscaler

    def autoscale(self) -> None:
        """One autoscaler step: the offered load of the bin starting now, `recommend`, and the fleet resized."""
        load = self.load.rate_at(self.now)
        if not self.fleet:  # the start: the fleet the load wants now, warm
            want = max(
                self.scaler.min_replicas, min(self.scaler.max_replicas, replicas_for(load, self.service.target_rps))
            )
            warm = True
        else:
            ready, desired = len(self.ready), len(self.fleet)
            values = [load / ready] * ready + [0.0] * (desired - ready) if ready else []
            want = recommend(self.scaler, desired, values, self.now, self.scaler_state).replicas
            warm = False
        while len(self.fleet) < want:
            self.add_replica(warm)
        while len(self.fleet) > want:
            self.remove_newest()
        self.row = (load, len(self.fleet))  # recorded once this instant's decision has run (`schedule`)
        if self.now + self.load.bin_s < self.horizon:
            self.push(self.now + self.load.bin_s, "tick", "")

    def add_replica(self, warm: bool) -> None:
        self.made += 1
        rid = f"serve-{self.made:05d}"
        s, gpus = self.service, self.setup.cluster.gpus
        job = ReplicaJob(rid, self.now, s.replica_nodes, gpus, s.priority, warm)
        request = GangRequest(
            rid,
            s.replica_nodes,
            gpus,
            s.priority,
            self.now,
            gpu_model=SERVE_POOL if self.pools else "",
            time_limit=math.inf,  # it runs until it is scaled down
        )
        st = _State(job, request, math.inf, PendingJob(request, SERVING_TENANT))
        self.fleet.append(st)
        self.pending[rid] = st

    def remove_newest(self) -> None:
        """Scale down by one: the newest replica goes (withdrawn if it still waits, stopped if it runs)."""
        st = self.fleet.pop()
        rid = st.job.job_id
        if rid in self.pending:
            del self.pending[rid]  # its claim and any victims' checkpoints are called off by the next decision
            return
        held = self.held(st)
        self.allocated -= held
        self.fair["hold"][SERVING_TENANT] -= held
        self.cap.release_placement(st.placed)
        st.placement = None
        self.running.pop(rid, None)
        self.ready.discard(rid)

    # ---- replicas in the engine's transitions

    def start(self, st: _State, placement: Placement) -> None:
        super().start(st, placement)
        if isinstance(st.job, ReplicaJob):
            if not st.job.warm:
                self.placement_delays.append(self.now - st.job.submit_s)
            if st.job.warm:
                self.ready.add(st.job.job_id)
            else:
                self.push(self.now + self.service.startup_s, "ready", st.job.job_id)

    def work_of(self, st: _State, placement: Placement) -> float:
        if isinstance(st.job, ReplicaJob):
            return math.inf  # no end, no checkpoints
        return super().work_of(st, placement)

    def _run_at_speed(self, st: _State, placement: Placement) -> None:
        if isinstance(st.job, ReplicaJob):
            st.rate, st.end_seq = 1.0, 0  # never finishes: it is scaled down
            return
        super()._run_at_speed(st, placement)

    # ---- the decision

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        if self.config.preemption is not None:
            snap.saved_at = _LastCheckpoint(self)
        return snap

    def schedule(self) -> None:
        super().schedule()
        while self.spilled:  # a replica spilled over to the whole cluster: decide again at once
            self.spilled = False
            super().schedule()
        if self.row is not None:  # an autoscaler step this instant: the state it left, after the decision
            (load, wanted), self.row = self.row, None
            placed = sum(1 for st in self.fleet if st.placement is not None)
            training = self.allocated - placed * self.replica_gpus
            self.series.append((self.now, load, wanted, len(self.ready), placed, training))
            if abs((self.now - self.load.model.peak_hour * 3600.0) % DAY_S) < 1e-6:
                self.ready_at_peaks.append(len(self.ready))

    def apply(self, plan: Plan) -> None:
        super().apply(plan)
        if self.serving_policy != PREEMPT_CHECKPOINT_BACKFILL:
            return
        for step in plan:
            if not isinstance(step, Wait) or step.status.code is not Code.UNSCHEDULABLE:
                continue
            st = self.pending.get(step.job)
            if st is not None and isinstance(st.job, ReplicaJob) and st.request.gpu_model == SERVE_POOL:
                # Its pool can give it nothing, not even by preemption: it may go anywhere now.
                st.request = dataclasses.replace(st.request, gpu_model="")
                st.queued = PendingJob(st.request, SERVING_TENANT)
                self.memo = Memo()  # its memoized "no victims" answer was for its pool
                self.spills += 1
                self.spilled = True

    # ---- the metrics

    def metrics(self) -> dict[str, Any]:
        """The run's figures over the window (see the module docstring)."""
        hours, total = self.horizon / 3600.0, float(self.total)
        a, delays = self.area, self.placement_delays
        training = training_metrics(self.states.values(), self.horizon)
        training_alloc_h = (self.area_alloc - a["serving_gpu_s"]) / 3600.0
        return {
            "policy": self.serving_policy,
            "hours": hours,
            "gpus": self.total,
            "serve_pool_nodes": self.pool_size,
            "serving": {
                "replica_hours": a["replica_s"] / 3600.0,
                "ready_replica_hours": a["ready_s"] / 3600.0,
                "gpu_hours": a["serving_gpu_s"] / 3600.0,
                "slo_time_share": a["ok_s"] / self.horizon,
                "unserved_request_share": a["unserved"] / a["offered"] if a["offered"] else 0.0,
                "ready_at_peaks": list(self.ready_at_peaks),
                "most_replicas": max((row[2] for row in self.series), default=0),
                "replicas_made": self.made,
                "placement_delay_mean_s": statistics.fmean(delays) if delays else 0.0,
                "placement_delay_max_s": max(delays, default=0.0),
                "spills": self.spills,
            },
            "training": training
            | {
                "preemptions": self.preemptions,
                "preempt_lost_gpu_hours": self.preempt_lost / 3600.0,
                "gpu_hours_allocated": training_alloc_h,
                "utilization": training_alloc_h / (total * hours),
            },
            "utilization": self.area_alloc / (total * self.horizon),
            "scheduling_passes": self.passes,
        }


def training_metrics(states: Iterable[_State], horizon: float) -> dict[str, Any]:
    """Goodput, completions, JCT and queueing delay of the training jobs, up to `horizon` (jobs still queued or
    running then are counted as such)."""
    states = list(states)
    goodput = Goodput()
    jct, waits = [], []
    started = finished = 0
    for st in states:
        gpus = demand(st.request)[0]
        goodput += account_job(st.job.submit_s, gpus, st.attempts, horizon, finished_at=st.finish)
        if st.first_start is not None:
            started += 1
            waits.append(st.first_start - st.job.submit_s)
        if st.finish is not None:
            finished += 1
            jct.append(st.finish - st.job.submit_s)
    return {
        "jobs": len(states),
        "started": started,
        "completed": finished,
        "goodput": goodput.ratio,
        "gpu_hours_productive": goodput.productive / 3600.0,
        "gpu_hours_rolled_back": goodput.rollback / 3600.0,
        "jct_mean_h": statistics.fmean(jct) / 3600.0 if jct else math.nan,
        "queue_delay_mean_h": statistics.fmean(waits) / 3600.0 if waits else math.nan,
    }
