"""The trace replay with node failures and a recovery policy: requeue, spares in the domain, elastic shrink, or
spares plus elastic (issue 34's evaluation).

The replay is `phalanx.sim.engine._Replay` under the `topo` policy: every scheduling pass is `decide`, the
scheduler's own decision, and every failure goes through `phalanx.core.recovery.decide_recovery`, the pure recovery
decision the scheduler's spares and elastic paths share. What this module adds:

- Failures: each node fails as a Poisson process at a published rate and is down for a repair time
  (`phalanx.sim.failures`; the same draws for every policy with the same seed).
- Large gangs (at least `large_nodes` whole nodes): under the spare policies each is placed, in the same atomic
  reservation, with K spare nodes per domain it spans (`spares_per_domain`; a domain is a leaf switch, the sim's
  NVLink-domain stand-in). The spares are held idle (their GPU-hours are counted), a spare used or lost is booked
  again from a free node of that domain when one appears (before each pass: ahead of the queue, as part of the
  gang's reservation), and they go when the gang ends or is requeued. Under the elastic policies a large gang may
  shrink to `ceil(elastic_min x size)` replicas, running proportionally slower (linear scaling), and grows back to
  full size when free nodes allow, after each pass (through the checkpoint handshake: no work lost, a warm restart).
- Every other job hit by a failure is requeued, under every policy.
- The restart-cost model is `phalanx.core.recovery.restart_cost`: the work since the last periodic checkpoint is lost;
  a swap or shrink costs a warm restart on the gang's nodes, a requeue its time in the queue and a cold start.

Metrics (`failure_metrics`): the effective training time ratio of the large jobs (ETTR, as ByteRobust defines it:
productive training time / wall time; here their trace work, at full size, over the wall time from their first start
to their finish, so time spent requeued, restarting, redoing lost work or running shrunk counts against it), their
goodput (`phalanx.core.goodput`), the GPU-hours held as spares, utilisation, mean JCT, and the count of each action.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.core.goodput import AttemptTimes, Goodput, account_job
from phalanx.core.model import Placement, ReplicaPlacement
from phalanx.core.recovery import (
    NOTHING,
    POLICIES,
    REQUEUE,
    SHRINK,
    GangAtFailure,
    Recovery,
    RestartCosts,
    checkpointed,
    decide_recovery,
)

from .cluster import ClusterSpec, Job
from .engine import _Replay, _State
from .failures import FailureModel, NodeFailures
from .fairness import _tenant
from .metrics import SimResult


@dataclass(frozen=True)
class RecoveryConfig:
    """The recovery policy and its settings (see the module docstring)."""

    policy: str = "requeue"
    failures: FailureModel = dataclasses.field(default_factory=FailureModel)
    costs: RestartCosts = dataclasses.field(default_factory=RestartCosts)
    spares_per_domain: int = 1
    large_nodes: int = 8
    elastic_min: float = 0.75

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown recovery policy {self.policy!r}; policies: {', '.join(POLICIES)}")
        if self.spares_per_domain < 0:
            raise ValueError(f"spares per domain must be >= 0, got {self.spares_per_domain}")
        if self.large_nodes < 1:
            raise ValueError(f"large_nodes must be >= 1, got {self.large_nodes}")
        if not 0 < self.elastic_min <= 1:
            raise ValueError(f"elastic_min must be in (0, 1], got {self.elastic_min}")

    @property
    def spares(self) -> bool:
        return self.policy in ("spares", "spares+elastic") and self.spares_per_domain > 0

    @property
    def elastic(self) -> bool:
        return self.policy in ("elastic", "spares+elastic")


def simulate_failures(jobs: Sequence[Job], cluster: ClusterSpec, config: RecoveryConfig, *, seed: int = 0) -> SimResult:
    """Replay `jobs` on `cluster` with failures, recovering under `config.policy`; the replay's metrics plus the
    recovery's (`failure_metrics`) in `result.metrics`."""
    replay = RecoveryReplay(jobs, cluster, config, seed=seed)
    replay.run()
    result = replay.result()
    result.metrics.update(failure_metrics(replay))
    result.metrics["policy"] = config.policy
    return dataclasses.replace(result, policy=config.policy)


class RecoveryReplay(_Replay):
    """`_Replay` (policy `topo`) with per-node failures and the recovery decision (module docstring)."""

    def __init__(self, jobs: Sequence[Job], cluster: ClusterSpec, config: RecoveryConfig, *, seed: int = 0) -> None:
        self.rc = config
        self.cluster = cluster
        # Large gangs: whole-node replicas, at least `large_nodes` of them.
        self.large = {j.job_id for j in jobs if j.gpus_per_replica == cluster.gpus and j.replicas >= config.large_nodes}
        super().__init__(
            jobs,
            cluster,
            "topo",
            failures_per_gpu_day=0.0,  # failures are this class's (below), not the base replay's
            checkpoint="none",  # checkpoints are the recovery cost model's (RestartCosts)
            checkpoint_cost_s=0.0,
            repair_s=0.0,
            seed=seed,
            speed=self._shrunk_speed,
            depth=200,
            network=None,
            comm_fraction=0.2,
            quotas=None,
            min_runtime_s=600.0,
            borrower_preempts=False,
            progress=None,
        )
        self.domain = {n: path[0] for n, path in self.paths.items()}
        self.members: dict[str, list[str]] = {}
        for n in sorted(self.cap.nodes):
            self.members.setdefault(self.domain[n], []).append(n)
        self.extra: dict[str, int] = {}
        if config.spares:  # the spares ride in the gang's own reservation
            k, per = config.spares_per_domain, cluster.per_leaf
            for job_id in self.large:
                st = self.states[job_id]
                size = st.request.replicas
                extra = k * math.ceil((size + k * math.ceil(size / per)) / per)
                self.extra[job_id] = extra
                st.request = dataclasses.replace(st.request, replicas=size + extra)
                st.queued = dataclasses.replace(st.queued, request=st.request)
        self.spares: dict[str, dict[str, list[str]]] = {}  # job -> domain -> spare nodes it holds
        self.spare_of: dict[str, str] = {}  # spare node -> its gang
        self.overhead: dict[str, float] = {}  # job -> restart seconds at the start of its current attempt
        self.cold: set[str] = set()  # requeued jobs: their next start is a cold start
        self.area_spare = 0.0
        self.counts = dict.fromkeys(("failures", "large_hits", "swap", "shrink", "requeue", "grow", "spare_lost"), 0)
        self.lost_work_s = 0.0  # gang-seconds of large jobs' work redone
        self.failure_log: list[tuple[float, str]] = []  # (when, node): the same for every policy, given the seed
        self.failures = NodeFailures(config.failures, seed)
        self.node_rate = config.failures.node_rate_per_s  # the base loop stops once all is done when > 0
        if self.node_rate > 0:
            for n in sorted(self.cap.nodes):
                self.push(self.failures.next_failure(n, 0.0), "fail", n)

    # ---- what a gang holds and how fast it runs ----------------------------------------------------------------

    def _shrunk_speed(self, job: Job, placement: Placement) -> float:
        """Slowdown of a shrunk gang: its full size over its size now (linear scaling)."""
        n = len(placement.replicas)
        return job.replicas / n if job.job_id in self.large and 0 < n < job.replicas else 1.0

    def held(self, st: _State) -> float:
        if st.placement is not None and st.job.job_id in self.large:
            return float(len(st.placement.replicas) * st.request.gpus_per_replica)
        return super().held(st)

    def spare_gpus(self) -> int:
        return len(self.spare_of) * self.cluster.gpus

    def advance_clock(self, t: float) -> None:
        self.area_spare += self.spare_gpus() * (t - self.last)
        super().advance_clock(t)

    # ---- start: carve the spares out of the gang's reservation -------------------------------------------------

    def work_of(self, st: _State, placement: Placement) -> float:
        restart = self.rc.costs.cold_start_s if st.job.job_id in self.cold else 0.0
        self.overhead[st.job.job_id] = restart
        return st.remaining_s + restart

    def start(self, st: _State, placement: Placement) -> None:
        job_id = st.job.job_id
        if job_id in self.extra:
            placement = self._carve_spares(job_id, placement)
        super().start(st, placement)
        restart = self.overhead.get(job_id, 0.0)
        if restart:
            a = st.attempts[-1]
            st.attempts[-1] = dataclasses.replace(a, running_at=a.reserved_at + restart)
        self.cold.discard(job_id)

    def _carve_spares(self, job_id: str, placement: Placement) -> Placement:
        """Split the gang's reservation (its replicas plus its spares, one node each) into the ranks and K spares
        per domain it spans; spares over K per domain go back to the free pool."""
        k, extra = self.rc.spares_per_domain, self.extra[job_id]
        by_domain: dict[str, list[ReplicaPlacement]] = {}
        for rep in placement.replicas:
            by_domain.setdefault(self.domain[rep.node], []).append(rep)
        spares: dict[str, list[str]] = {}
        picked: set[str] = set()
        # Domains holding most of the gang first; within one, the last nodes of the placement become spares.
        for _ in range(k):
            for dom, reps in sorted(by_domain.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                if len(picked) == extra:
                    break
                free = [r for r in reps if r.node not in picked]
                if len(free) > 1:
                    picked.add(free[-1].node)
                    spares.setdefault(dom, []).append(free[-1].node)
        surplus = [r for r in reversed(placement.replicas) if r.node not in picked][: extra - len(picked)]
        for rep in surplus:
            self.cap.release_replica(rep)
        gone = picked | {r.node for r in surplus}
        ranks = tuple(
            ReplicaPlacement(i, r.node, r.gpus)
            for i, r in enumerate(r for r in placement.replicas if r.node not in gone)
        )
        self.spares[job_id] = spares
        for dom_nodes in spares.values():
            for node in dom_nodes:
                self.spare_of[node] = job_id
        return dataclasses.replace(placement, replicas=ranks)

    def _release_spares(self, job_id: str) -> None:
        for nodes in self.spares.pop(job_id, {}).values():
            for node in nodes:
                self._free_node(node)
                self.spare_of.pop(node, None)

    def _free_node(self, node: str) -> None:
        self.cap.release(node, range(self.cluster.gpus))

    def _whole_free(self, node: str) -> bool:
        n = self.cap.nodes[node]
        return n.schedulable and len(n.free) == n.total and node not in self.down

    def stop(self, st: _State, *, finished: bool, released: bool = False) -> None:
        super().stop(st, finished=finished, released=released)
        self._release_spares(st.job.job_id)

    # ---- failures ----------------------------------------------------------------------------------------------

    def handle(self, kind: str, key: str, ev_seq: int) -> None:
        if kind == "fail":
            self.on_failure(key)
        elif kind == "repair":
            self.down.discard(key)
            self.cap.set_schedulable(key, True)
            self.push(self.failures.next_failure(key, self.now), "fail", key)
        else:
            super().handle(kind, key, ev_seq)

    def on_failure(self, node: str) -> None:
        if node in self.down:
            return
        self.counts["failures"] += 1
        self.failure_log.append((self.now, node))
        self.down.add(node)
        self.cap.set_schedulable(node, False)
        owner = self.spare_of.pop(node, None)
        if owner is not None:  # a spare died: its slot is a missing spare until one is booked again
            self.spares[owner][self.domain[node]].remove(node)
            self._free_node(node)
            self.counts["spare_lost"] += 1
        for st in [s for s in self.running.values() if node in s.placed.nodes]:
            self.recover(st, node)
        self.push(self.now + self.failures.repair_s(node), "repair", node)

    def recover(self, st: _State, node: str) -> None:
        """The recovery decision for the gang `st` that lost `node`, applied."""
        job_id = st.job.job_id
        large = job_id in self.large
        policy = self.rc.policy if large else "requeue"
        ranks = tuple(r.node for r in st.placed.replicas)
        dom = self.domain[node]
        gang = GangAtFailure(
            job_id,
            ranks,
            {n: self.domain[n] for n in ranks},
            min_replicas=math.ceil(self.rc.elastic_min * st.job.replicas) if large and self.rc.elastic else len(ranks),
            spares=self.spares.get(job_id, {}),
        )
        free = {dom: [n for n in self.members[dom] if self._whole_free(n)]} if self.rc.spares and large else {}
        decision = decide_recovery(gang, {node}, policy, free)
        if decision.action == NOTHING:
            return
        self.counts["large_hits"] += large
        self.counts[decision.action] += large
        self.advance(st)
        useful_wall = max(0.0, self.now - st.started - self.overhead.get(job_id, 0.0))
        kept_wall = checkpointed(useful_wall, self.rc.costs)
        kept_work = kept_wall * st.rate
        if large:
            self.lost_work_s += (useful_wall - kept_wall) * st.rate
        a = st.attempts[-1]
        kept_until = (a.running_at or a.reserved_at) + kept_wall if kept_wall else None
        if decision.action == REQUEUE:
            self.stop(st, finished=False)
            st.remaining_s = max(0.0, st.remaining_s - kept_work)
            st.attempts[-1] = dataclasses.replace(st.attempts[-1], kept_until=kept_until)
            self.cold.add(job_id)
            return
        st.attempts[-1] = AttemptTimes(
            a.attempt, a.gpus, a.reserved_at, a.running_at, self.now, "NODE_LOST", kept_until=kept_until
        )
        st.remaining_s = max(0.0, st.remaining_s - kept_work)
        self._restart_in_place(st, decision)

    def _restart_in_place(self, st: _State, decision: Recovery) -> None:
        """A swap or a shrink: the gang's placement becomes `decision.ranks`, warm, from its checkpoint."""
        job_id = st.job.job_id
        old = st.placed
        for _failed, new, from_free in decision.swaps:
            if not from_free:  # a held spare: its booking becomes the rank's
                self.spares[job_id][self.domain[new]].remove(new)
                self.spare_of.pop(new, None)
                self._free_node(new)
        by_rank = dict(zip((r.node for r in old.replicas), decision.ranks, strict=False))
        if decision.action == SHRINK:
            kept = list(decision.ranks)
            reps: list[ReplicaPlacement] = []
            for rep in old.replicas:
                if kept and rep.node == kept[0]:
                    kept.pop(0)
                    reps.append(ReplicaPlacement(len(reps), rep.node, rep.gpus))
        else:
            reps = [ReplicaPlacement(r.replica, by_rank.get(r.node, r.node), r.gpus) for r in old.replicas]
        self._replace(st, dataclasses.replace(old, replicas=tuple(reps)), self.rc.costs.warm_restart_s)

    def _replace(self, st: _State, placement: Placement, restart_s: float) -> None:
        """Move the running gang to `placement` (its GPUs taken here), restarting after `restart_s`: a new attempt."""
        job_id = st.job.job_id
        held_before = self.held(st)
        self.running.pop(job_id)
        self.cap.release_placement(st.placed)
        self.cap.reserve(placement)
        st.placement = placement
        held = self.held(st)
        self.allocated += held - held_before
        self.fair["hold"][_tenant(st.job)] += held - held_before
        st.started = st.last = self.now
        st.attempts.append(AttemptTimes(len(st.attempts) + 1, held, self.now, self.now + restart_s))
        self.overhead[job_id] = restart_s
        slow = self._shrunk_speed(st.job, placement)
        st.work_left, st.attempt_work = st.remaining_s + restart_s / slow, 0.0
        self.running[job_id] = st
        self.running.views[job_id] = self._view(st)
        self._run_at_speed(st, placement)

    # ---- after each pass: spares booked again, shrunk gangs grown ----------------------------------------------

    def schedule(self) -> None:
        # Missing spares first: they belong to their gang's reservation, ahead of the queue; growing a shrunk
        # gang is opportunistic, on what the pass left free.
        if self.rc.spares:
            self._top_up_spares()
        super().schedule()
        if self.rc.elastic:
            self._grow_shrunk()

    def _top_up_spares(self) -> None:
        k = self.rc.spares_per_domain
        for job_id, by_domain in self.spares.items():
            st = self.running.get(job_id)
            if st is None:
                continue
            for dom in {self.domain[n] for n in st.placed.nodes}:
                have = by_domain.setdefault(dom, [])
                if len(have) >= k:
                    continue
                for node in self.members[dom]:
                    if len(have) >= k:
                        break
                    if self._whole_free(node):
                        self.cap.take(node, range(self.cluster.gpus))
                        have.append(node)
                        self.spare_of[node] = job_id

    def _grow_shrunk(self) -> None:
        for job_id in sorted(self.large):
            st = self.running.get(job_id)
            if st is None or len(st.placed.replicas) >= st.job.replicas:
                continue
            if self.now < st.started + self.overhead.get(job_id, 0.0):
                continue  # still restarting: grow once it computes
            want = st.job.replicas - len(st.placed.replicas)
            mine = {self.domain[n] for n in st.placed.nodes}
            free = [n for d in sorted(mine) for n in self.members[d] if self._whole_free(n)]
            if len(free) < want:
                free += [n for n in sorted(self.cap.nodes) if self.domain[n] not in mine and self._whole_free(n)]
            if len(free) < want:
                continue
            # Through the checkpoint handshake: everything done so far is kept, then a warm restart at full size.
            self.advance(st)
            done = max(0.0, self.now - st.started - self.overhead.get(job_id, 0.0)) * st.rate
            a = st.attempts[-1]
            st.attempts[-1] = AttemptTimes(
                a.attempt, a.gpus, a.reserved_at, a.running_at, self.now, "RESIZED", self.now
            )
            st.remaining_s = max(0.0, st.remaining_s - done)
            reps = list(st.placed.replicas)
            gpus = reps[0].gpus
            reps += [ReplicaPlacement(len(reps) + i, n, gpus) for i, n in enumerate(free[:want])]
            self.counts["grow"] += 1
            self._replace(st, dataclasses.replace(st.placed, replicas=tuple(reps)), self.rc.costs.warm_restart_s)


def failure_metrics(replay: RecoveryReplay) -> dict[str, Any]:
    """The recovery's figures of a finished `RecoveryReplay` (module docstring)."""
    large = [replay.states[j] for j in sorted(replay.large)]
    done = [s for s in large if s.finish is not None and s.first_start is not None]
    work = sum(s.job.duration_s for s in done)
    wall = sum(s.finish - s.first_start for s in done if s.finish is not None and s.first_start is not None)
    goodput = Goodput()
    for s in large:
        gpus = float(s.job.replicas * s.job.gpus_per_replica)
        goodput += account_job(s.job.submit_s, gpus, s.attempts, replay.now, finished_at=s.finish)
    jct = [s.finish - s.job.submit_s for s in done if s.finish is not None]
    total_area = replay.total * max(replay.now, 1e-9)
    return {
        "recovery_policy": replay.rc.policy,
        "large_jobs": len(large),
        "large_completed": len(done),
        "ettr": work / wall if wall > 0 else float("nan"),
        "large_goodput": goodput.as_dict() | {"ratio": goodput.ratio},
        "large_jct_mean_h": sum(jct) / len(jct) / 3600 if jct else float("nan"),
        "spare_gpu_hours": replay.area_spare / 3600,
        "utilization_with_spares": (replay.area_alloc + replay.area_spare) / total_area,
        "lost_work_gang_hours": replay.lost_work_s / 3600,
        "node_failures": replay.counts["failures"],
        "large_gang_hits": replay.counts["large_hits"],
        "swaps": replay.counts["swap"],
        "shrinks": replay.counts["shrink"],
        "requeues": replay.counts["requeue"],
        "grows": replay.counts["grow"],
        "spares_lost": replay.counts["spare_lost"],
    }
