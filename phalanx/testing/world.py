"""A model of the world around the decision core, for the randomized invariant checker.

`World` does what the cluster and the scheduler's cycle do around `phalanx.core.decide.decide`, with a virtual
clock: it builds the snapshot from its state, decides, applies the plan (reservations start attempts, asks make
victims checkpoint, stops end attempts and requeue them, claims are kept), and makes the world happen:
- releases confirmed late, in any order across a gang's nodes (the clean GPU handover: an ended attempt's whole
  GPUs stay held on nodes whose agents confirm releases until they do);
- checkpoints that commit early, late or never once a victim is asked;
- gangs that finish, ranks that fail (requeued after a backoff, up to `max_attempts`), time limits;
- nodes that die (their gangs torn down and requeued) and return; GPUs that fail; MIG mode switches of idle GPUs;
- cancels; quotas with cohorts.

Every change is recorded as a `phalanx.core.invariants` event and fed to a `Checker` at once, so a run stops at the
first step that breaks an invariant. A `Scenario` is data (a cluster, queues, a policy and a list of actions, each
action picking its object by index modulo what exists then), so that it can be drawn by Hypothesis (which shrinks
it), by a seeded generator (bench/invariants.py) and written as a readable row (`parse_actions`).

The scenario's data and its readable rows are in `phalanx.testing.scenario`, the seeded generator and the shrinker
in `phalanx.testing.generate`; this module plays a scenario (`World`, `run`) and re-exports their names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from phalanx.core import invariants as inv
from phalanx.core.capacity import ClusterCapacity
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
    Wait,
    WakeAt,
    decide,
)
from phalanx.core.fabric import default_fabric, group_nvlink_domains
from phalanx.core.gang_recovery import choose_swap, elastic_gang
from phalanx.core.model import FULL_MIG_MASK, GangRequest, NodeCapacity, Placement, ReplicaPlacement
from phalanx.core.placement import place_gang
from phalanx.core.preemption import PreemptionPolicy
from phalanx.core.quota import QuotaBook, cluster_totals, demand
from phalanx.core.recovery import REQUEUE, decide_recovery
from phalanx.core.snapshot import ElasticPolicy
from phalanx.core.spares import SpareSlot, split_spares

# A scenario's data and rows, and its generation, live in their own modules; every name stays importable from here.
from .generate import PROFILES, VERBS, WEIGHTS, fill, random_job, random_scenario, shrink  # noqa: F401
from .scenario import MODELS, Action, ClusterSpec, JobSpec, Scenario, format_actions, parse_actions


@dataclass
class _Job:
    spec: JobSpec
    request: GangRequest
    state: str = "PENDING"  # PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED
    attempt: int = 0
    failures: int = 0
    not_before: float = 0.0
    work_left: float = 0.0
    placement: Placement | None = None
    started_at: float = 0.0
    flavor: str = ""
    preempted_by: str = ""
    deadline: float = 0.0
    commit_at: float = math.inf  # when its asked-for checkpoint commits
    committed: bool = False
    saved_at: float = 0.0  # its last committed checkpoint (this attempt)
    fail_at: float = math.inf
    slots: list[SpareSlot] = field(default_factory=list)  # its spares kept in the domain (booked or missing)


@dataclass
class _Node:
    name: str
    gpus: int
    path: tuple[str, ...]
    model: str
    memory_mib: int
    confirms: bool
    up: bool = True
    mig: set[int] = field(default_factory=set)
    fatal: set[int] = field(default_factory=set)
    switching: dict[int, float] = field(default_factory=dict)  # GPU -> when its MIG mode switch ends
    releasing: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)  # ended attempt -> GPUs held


class StopRun(Exception):
    """The run met a violation (the world stops at the first)."""


class World:
    """The model world (see the module docstring). `claims`: the decision's claims (off: what breaks without)."""

    def __init__(self, scenario: Scenario, *, claims: bool = True, check: bool = True) -> None:
        self.scenario = scenario
        c = scenario.cluster
        names = [f"node-{i + 1:02d}" for i in range(c.nodes)]
        fabric = default_fabric(names, nodes_per_leaf=max(1, c.per_leaf), leaves_per_spine=8)
        if c.nvlink > 0:
            fabric = group_nvlink_domains(fabric, c.nvlink)
        self.tiers = fabric.tiers
        self.nodes: dict[str, _Node] = {}
        for i, name in enumerate(names):
            model, memory = MODELS[1] if c.mixed and i >= (c.nodes + 1) // 2 else MODELS[0]
            confirms = c.confirming == "all" or (c.confirming == "odd" and i % 2 == 0)
            node = _Node(name, c.gpus, fabric.path(name), model, memory, confirms)
            if i == c.nodes - 1 and model == MODELS[0][0]:
                node.mig = set(range(max(0, c.gpus - c.mig_gpus), c.gpus))
            self.nodes[name] = node
        self.queues = {q.name: q for q in scenario.queues}
        self.policy = PreemptionPolicy(min_runtime_s=scenario.min_runtime_s, grace_period_s=scenario.grace_s)
        # Elastic gangs grow (phalanx.core.elastic) every few seconds at most, with the victims' grace period.
        grow = ElasticPolicy(grow_interval_s=5.0, grace_period_s=scenario.grace_s)
        self.config = DecideConfig(tiers=self.tiers, preemption=self.policy, poll_s=1.0, claims=claims, elastic=grow)
        self.memo = Memo()
        self.now = 0.0
        self.jobs: dict[str, _Job] = {}
        self.order: list[str] = []  # submission order (the pending queue's tie-break)
        self.claims: dict[str, Claim] = {}
        self.wake = math.inf
        self.history: list[inv.Event] = []
        self.checker = inv.Checker(grace_s=scenario.grace_s, tick_s=0.0, queues=self.queues or None) if check else None
        self.violations: list[inv.Violation] = []
        self.decisions = 0
        self.record(
            inv.Cluster(
                0.0,
                {n.name: n.gpus for n in self.nodes.values()},
                frozenset((n.name, g) for n in self.nodes.values() for g in n.mig),
                tuple(self.tiers),
                {
                    tier: {n.name: n.path[i] for n in self.nodes.values() if i < len(n.path)}
                    for i, tier in enumerate(self.tiers)
                }
                | {"node": {n: n for n in self.nodes}},
            )
        )

    # -- recording

    def record(self, event: inv.Event) -> None:
        self.history.append(event)
        if self.checker is not None:
            found = self.checker.feed(event)
            if found:
                self.violations += found
                raise StopRun(str(found[0]))

    # -- the snapshot

    def capacity(self) -> ClusterCapacity:
        """The free capacity as the world holds it: running gangs, releasing GPUs and unusable ones taken."""
        cap = ClusterCapacity(
            NodeCapacity(
                n.name,
                n.gpus,
                set(range(n.gpus)) - n.mig,
                n.up,
                n.path,
                None,
                n.model,
                n.memory_mib,
                mig_gpus=frozenset(n.mig),
            )
            for n in self.nodes.values()
        )
        for job in self.jobs.values():
            if job.state == "RUNNING" and job.placement is not None:
                for rep in job.placement.replicas:
                    if rep.mig_profile or rep.gpu_milli:
                        cap.take_partial(rep)
                    else:
                        cap.take(rep.node, rep.gpus)
        for n in self.nodes.values():
            held = self.unusable_on(n)
            for gpus in n.releasing.values():
                cap.take(n.name, set(gpus) - held)
            if held:
                cap.take(n.name, held)
        return cap

    def unusable_on(self, n: _Node) -> set[int]:
        return n.fatal | set(n.switching)

    def snapshot(self) -> Snapshot:
        pending = [
            PendingJob(j.request, j.spec.queue, j.not_before, j.spec.by_admin, j.spec.preempts)
            for j in (self.jobs[i] for i in self.order)
            if j.state == "PENDING"
        ]
        running: dict[str, RunningJob] = {}
        for job_id in self.order:
            j = self.jobs[job_id]
            if j.state != "RUNNING" or j.placement is None:
                continue
            running[job_id] = RunningJob(
                j.request,
                j.placement,
                j.started_at,
                j.spec.queue,
                j.flavor,
                j.attempt,
                j.started_at,
                demand(j.request)[0] or 1.0,
                j.preempted_by,
                j.deadline,
                not j.committed,
            )
        unusable = {n.name: self.unusable_on(n) for n in self.nodes.values() if self.unusable_on(n)}
        releasing = [
            Placement(f"{job}/{attempt}", (ReplicaPlacement(0, n.name, gpus),), "", 0, 0.0, "releasing")
            for n in self.nodes.values()
            for (job, attempt), gpus in n.releasing.items()
        ]
        return Snapshot(
            capacity=self.capacity(),
            pending=pending,
            running=running,
            config=self.config,
            unusable=unusable,
            queues=self.queues,
            totals=self.totals(),
            saved_at={j: self.jobs[j].saved_at for j in running if self.jobs[j].saved_at},
            memo=self.memo,
            hold_on_stop=frozenset(n.name for n in self.nodes.values() if n.confirms),
            releasing=releasing,
            claims=dict(self.claims),
        )

    def totals(self) -> dict[str, float]:
        if not self.queues:
            return {}
        return cluster_totals((n.model, n.memory_mib, g in n.mig) for n in self.nodes.values() for g in range(n.gpus))

    # -- deciding

    def decide(self) -> Plan:
        """One decision, applied; then the index it left must be the world's own."""
        snap = self.snapshot()
        plan = decide(snap, self.now)
        self.decisions += 1
        self.apply(plan)
        self.check_index(snap.capacity)
        return plan

    def check_index(self, cap: ClusterCapacity) -> None:
        """The decision's contract: its index holds the cluster as the plan leaves it (a claim hidden and not shown
        again, a release forgotten, would show here)."""
        mine = self.capacity()
        for name, node in mine.nodes.items():
            other = cap.nodes[name]
            if (node.free, node.mig, node.milli) != (other.free, other.mig, other.milli):
                self.record_violation(
                    "a",
                    f"the decision left node {name}'s index at free={sorted(other.free)} mig={other.mig} "
                    f"milli={other.milli}, the world holds free={sorted(node.free)} mig={node.mig} milli={node.milli}",
                )

    def record_violation(self, invariant: str, what: str) -> None:
        v = inv.Violation(invariant, len(self.history), self.now, what)
        self.violations.append(v)
        raise StopRun(str(v))

    def apply(self, plan: Plan) -> None:
        head = next((s for s in plan if isinstance(s, Wait) and s.reservation is not None), None)
        reserved = False
        for step in plan:
            if isinstance(step, AskCheckpoint) and not reserved:
                # The head's reservation was planned by the backfill pass, before this decision asked any victim:
                # recorded before the asks, so a witness their deadlines move is seen as moved by them.
                self.record_reservation(head)
                reserved = True
            if isinstance(step, Reserve):
                self.start(self.jobs[step.job], step.placement, step.flavor)
            elif isinstance(step, AskCheckpoint):
                self.ask(self.jobs[step.job], step)
            elif isinstance(step, Stop):
                self.end(self.jobs[step.job], "RESIZED" if step.resize else "PREEMPTED", requeue=True, backoff=False)
            elif isinstance(step, CallOff):
                job = self.jobs[step.job]
                grow = job.preempted_by == job.spec.job  # a grow called off keeps its deadline (its last try)
                job.preempted_by, job.deadline, job.commit_at = "", job.deadline if grow else 0.0, math.inf
                self.record(inv.CalledOff(self.now, job.spec.job, job.attempt))
            elif isinstance(step, SetClaim):
                self.claims[step.claim.job] = step.claim
                self.record(inv.ClaimMade(self.now, step.claim.job, holds_of(step.claim.replicas), step.claim.victims))
            elif isinstance(step, EndClaim):
                self.claims.pop(step.job, None)
                self.record(inv.ClaimEnded(self.now, step.job, step.reason))
            elif isinstance(step, WakeAt):
                self.wake = min(self.wake, step.t)
        if not reserved:
            self.record_reservation(head)

    def record_reservation(self, head: Wait | None) -> None:
        if head is not None and head.reservation is not None:
            self.record(inv.Reserved(self.now, head.job, head.reservation.start))
        else:
            self.record(inv.Reserved(self.now, "", math.nan))

    def start(self, job: _Job, placement: Placement, flavor: str) -> None:
        job.state, job.attempt, job.placement, job.flavor = "RUNNING", job.attempt + 1, placement, flavor
        job.started_at, job.committed, job.saved_at = self.now, False, 0.0
        job.preempted_by, job.deadline, job.commit_at = "", 0.0, math.inf
        # A failing attempt fails half way through its work.
        job.fail_at = self.now + job.work_left / 2 if job.failures < job.spec.fails else math.inf
        if job.spec.spares and job.spec.segment:  # the gang and its spares (negative replicas), one placement
            gang, job.slots = split_spares(placement, job.spec.segment, job.spec.spares)
            spares = tuple(ReplicaPlacement(s.replica, s.node, s.gpus) for s in job.slots)
            job.placement = placement = replace(gang, replicas=gang.replicas + spares)
        replicas = len(placement.replicas) if job.request.elastic else job.request.replicas  # (h) judges its size
        expected = replicas * (1 if job.request.partial else job.request.gpus_per_replica)
        self.record_start(job, expected, flavor)

    def record_start(self, job: _Job, expected: int, flavor: str, swap_of: int = 0) -> None:
        assert job.placement is not None
        reps = sorted(job.placement.replicas, key=lambda r: r.replica)
        ranks = tuple(r.node for r in reps if r.replica >= 0)
        booked = tuple((s.segment, s.node) for s in job.slots if s.booked)
        spare_holds = holds_of(r for r in reps if r.replica < 0)
        self.record(
            inv.Started(
                self.now,
                job.spec.job,
                job.attempt,
                holds_of(reps),
                expected,
                flavor,
                ranks,
                spares=booked,
                spare_holds=spare_holds,
                swap_of=swap_of,
            )
        )

    def swap(self, job: _Job, dead: str) -> bool:
        """Spares kept in the domain: a spare of the dead node's segment domain takes each of its replicas, and the
        gang restarts at once on its other GPUs (its last checkpoint kept), as the scheduler's swap does; False
        when the domain has none left (the caller tears the gang down)."""
        p = job.placement
        if not job.slots or p is None:
            return False
        actives = [(r.replica, r.node) for r in p.replicas if r.replica >= 0]
        if all(node != dead for _, node in actives):
            return True  # only a spare was there: the gang runs on (the spare, on a down node, is never taken)
        unusable = {n.name for n in self.nodes.values() if not n.up or n.fatal}
        chosen = choose_swap(actives, job.slots, job.spec.segment, p.segments, dead, unusable)
        if chosen is None:
            return False
        used = {s.replica for s in chosen.values()}
        if job.committed or job.saved_at:
            job.work_left = max(0.0, job.work_left - (job.saved_at - job.started_at))
        self.record(inv.Ended(self.now, job.spec.job, job.attempt, "NODE_LOST", ()))
        kept = []
        for r in p.replicas:
            if r.replica in chosen:
                kept.append(replace(r, node=chosen[r.replica].node, gpus=chosen[r.replica].gpus))
            elif r.node != dead and r.replica not in used:
                kept.append(r)
        job.slots = [replace(s, node="", gpus=()) if s.replica in used or s.node == dead else s for s in job.slots]
        job.placement = replace(p, replicas=tuple(kept))
        job.attempt += 1
        job.started_at, job.committed, job.saved_at = self.now, False, 0.0
        g = job.request.gpus_per_replica
        self.record_start(job, len(kept) * g, job.flavor, swap_of=job.attempt - 1)
        return True

    def ask(self, job: _Job, step: AskCheckpoint) -> None:
        job.preempted_by, job.deadline = step.by, step.deadline
        kind = job.spec.checkpoint
        job.commit_at = (
            self.now + 0.1
            if kind == "early"
            else self.now + self.scenario.grace_s * 0.8
            if kind == "late"
            else math.inf
        )
        if step.by != job.spec.job:  # (an elastic gang checkpointing for its own grow is no preemption)
            self.record(inv.Asked(self.now, job.spec.job, job.attempt, step.by, step.reclaim))

    def end(self, job: _Job, outcome: str, *, requeue: bool, backoff: bool, final: str = "") -> None:
        """End the running attempt: its whole GPUs stay held on confirming nodes (its ranks were killed, their
        processes exit in their own time) unless it finished by itself (every rank reported its end)."""
        assert job.placement is not None
        held: list[str] = []
        killed = outcome != "SUCCEEDED"
        for rep in job.placement.replicas:
            node = self.nodes[rep.node]
            if killed and node.confirms and node.up and not (rep.mig_profile or rep.gpu_milli):
                key = (job.spec.job, job.attempt)
                node.releasing[key] = tuple(sorted({*node.releasing.get(key, ()), *rep.gpus}))
                if rep.node not in held:
                    held.append(rep.node)
        # Work kept: up to the last committed checkpoint (or all of it when it finished).
        if outcome == "SUCCEEDED":
            job.work_left = 0.0
        elif job.committed or job.saved_at:
            job.work_left = max(0.0, job.work_left - (job.saved_at - job.started_at))
        self.record(inv.Ended(self.now, job.spec.job, job.attempt, outcome, tuple(held)))
        job.placement, job.preempted_by, job.deadline, job.commit_at = None, "", 0.0, math.inf
        job.fail_at = math.inf
        if backoff:
            job.failures += 1
            if job.failures >= self.scenario.max_attempts:
                final = "FAILED"
        if final or not requeue:
            job.state = final or "FAILED"
            self.record(inv.Finished(self.now, job.spec.job, job.state))
            return
        job.state = "PENDING"
        job.not_before = self.now + min(60.0, self.scenario.backoff_s * 2 ** (job.failures - 1)) if backoff else 0.0

    # -- the world's actions (each followed by a decision)

    def act(self, action: Action) -> None:
        verb, arg = action
        getattr(self, "do_" + verb)(arg)
        self.decide()

    def do_submit(self, spec: object) -> None:
        assert isinstance(spec, JobSpec)
        if spec.job in self.jobs:
            spec = replace(spec, job=f"{spec.job}.{len(self.jobs)}")
        request = spec.request(self.now)
        job = _Job(spec, request, work_left=spec.work)
        self.jobs[spec.job] = job
        self.order.append(spec.job)
        self.record(
            inv.Submitted(
                self.now,
                spec.job,
                spec.priority,
                spec.queue,
                spec.replicas if spec.spares else request.replicas,
                request.gpus_per_replica,
                demand(request),
                self.fits_empty(request, spec.queue),
                spec.preempts,
                spec.segment if spec.spares else request.segment,
                request.segment_tier,
                spec.spares if spec.segment else 0,
                spec.min_replicas if request.elastic else 0,
            )
        )

    def fits_empty(self, request: GangRequest, queue: str) -> bool:
        """Whether the gang fits the empty cluster as it is (nodes up, MIG modes as they are) and its quota admits
        it there: only those are owed liveness."""
        empty = ClusterCapacity(
            NodeCapacity(
                n.name,
                n.gpus,
                set(range(n.gpus)) - n.mig,
                True,
                n.path,
                None,
                n.model,
                n.memory_mib,
                mig_gpus=frozenset(n.mig),
            )
            for n in self.nodes.values()
        )
        if not isinstance(place_gang(empty, request, self.tiers), Placement):
            return False
        if self.queues:
            admitted = QuotaBook(self.queues, {}, self.totals()).admit(queue, request)
            return isinstance(admitted, list)
        return True

    def do_advance(self, seconds: object) -> None:
        """Let time pass, deciding at every moment something happens (the cycles the scheduler would run)."""
        target = self.now + float(seconds)  # type: ignore[arg-type]
        same, last = 0, self.now
        while True:
            t = min(target, self.next_event())
            if t > self.now:
                self.now = t
            same = same + 1 if self.now == last else 0
            last = self.now
            if same > 100:
                self.record_violation("d", "the decision does not act on what is due now (time stands still)")
            self.happen()
            if self.now >= target:
                return
            self.decide()

    def next_event(self) -> float:
        t = self.wake if self.wake > self.now else math.inf
        for j in self.jobs.values():
            if j.state == "RUNNING":
                t = min(t, j.started_at + j.work_left, j.fail_at, j.commit_at)
                if j.spec.time_limit:
                    t = min(t, j.started_at + j.spec.time_limit)
                if j.preempted_by:
                    t = min(t, j.deadline)
            elif j.state == "PENDING" and j.not_before > self.now:
                t = min(t, j.not_before)
        for n in self.nodes.values():
            for end in n.switching.values():
                t = min(t, end)
        return max(t, self.now)

    def happen(self) -> None:
        """What the clock brings about now: checkpoints commit, gangs finish, fail or hit their limits, MIG mode
        switches end."""
        now = self.now
        if self.wake <= now:
            self.wake = math.inf
        for job in [self.jobs[i] for i in self.order]:
            if job.state != "RUNNING":
                continue
            if job.commit_at <= now:
                job.committed, job.saved_at, job.commit_at = True, now, math.inf
            if job.started_at + job.work_left <= now + 1e-9:
                self.end(job, "SUCCEEDED", requeue=False, backoff=False, final="SUCCEEDED")
            elif job.fail_at <= now:
                self.end(job, "RANK_FAILED", requeue=True, backoff=True)
            elif job.spec.time_limit and now >= job.started_at + job.spec.time_limit:
                self.end(job, "TIMEOUT", requeue=False, backoff=False, final="FAILED")
        for n in self.nodes.values():
            for gpu, end in list(n.switching.items()):
                if end <= now:
                    del n.switching[gpu]
                    (n.mig.discard if gpu in n.mig else n.mig.add)(gpu)

    def do_release(self, k: object) -> None:
        """A node confirms that an ended attempt's processes there are gone."""
        held = [(n, key) for n in self.nodes.values() for key in n.releasing]
        if not held:
            return
        node, key = held[int(k) % len(held)]  # type: ignore[call-overload]
        del node.releasing[key]
        self.record(inv.Released(self.now, key[0], key[1], node.name))

    def do_commit(self, k: object) -> None:
        """A victim's checkpoint commits now (whatever its habit)."""
        asked = [j for j in self.jobs.values() if j.state == "RUNNING" and j.preempted_by and not j.committed]
        if asked:
            job = asked[int(k) % len(asked)]  # type: ignore[call-overload]
            job.committed, job.saved_at, job.commit_at = True, self.now, math.inf

    def do_fail(self, k: object) -> None:
        """A rank of a running gang exits non-zero: the gang is torn down and requeued after a backoff."""
        running = [j for j in self.jobs.values() if j.state == "RUNNING"]
        if running:
            self.end(running[int(k) % len(running)], "RANK_FAILED", requeue=True, backoff=True)  # type: ignore[call-overload]

    def do_down(self, k: object) -> None:
        """A node dies: every gang with a replica there is torn down (requeued after a backoff)."""
        up = [n for n in self.nodes.values() if n.up]
        if len(up) <= 1:
            return
        node = up[int(k) % len(up)]  # type: ignore[call-overload]
        node.up = False
        self.record(inv.NodeDown(self.now, node.name))
        for job in list(self.jobs.values()):
            if job.state == "RUNNING" and job.placement is not None and node.name in job.placement.nodes:
                if not self.swap(job, node.name):  # spares kept in the domain first, then an elastic shrink
                    self.end(job, "NODE_LOST", requeue=True, backoff=not self.shrinks(job))

    def shrinks(self, job: _Job) -> bool:
        """An elastic gang that still has its minimum of replicas on usable nodes and GPUs restarts at once (the
        scheduler's services/scheduler/elastic.py): no failure counted, no backoff."""
        if not job.request.elastic or job.placement is None:
            return False
        actives = [r for r in job.placement.replicas if r.replica >= 0]  # (a spare is no rank)
        lost = {
            r.replica
            for r in actives
            if not self.nodes[r.node].up or set(r.gpus) & self.unusable_on(self.nodes[r.node])
        }
        spec = job.spec
        gang, failed = elastic_gang(spec.job, [r.replica for r in actives], spec.min_replicas, lost, spec.segment or 1)
        return decide_recovery(gang, failed, "elastic").action != REQUEUE

    def do_up(self, k: object) -> None:
        """A node returns: its agent restarted, nothing of the ended attempts runs there; its GPUs are healthy."""
        down = [n for n in self.nodes.values() if not n.up]
        if not down:
            return
        node = down[int(k) % len(down)]  # type: ignore[call-overload]
        node.up, node.fatal = True, set()
        node.releasing.clear()
        self.record(inv.NodeUp(self.now, node.name))

    def do_cancel(self, k: object) -> None:
        live = [j for j in self.jobs.values() if j.state in ("PENDING", "RUNNING")]
        if not live:
            return
        job = live[int(k) % len(live)]  # type: ignore[call-overload]
        if job.state == "RUNNING":
            self.end(job, "CANCELLED", requeue=False, backoff=False, final="CANCELLED")
        else:
            job.state = "CANCELLED"
            self.record(inv.Finished(self.now, job.spec.job, "CANCELLED"))

    def do_gpu(self, k: object) -> None:
        """A GPU fails (fatal): the gang on it is torn down, the GPU stays out until its node is repaired."""
        up = [n for n in self.nodes.values() if n.up]
        if not up:
            return
        node = up[int(k) % len(up)]  # type: ignore[call-overload]
        gpu = int(k) % node.gpus  # type: ignore[call-overload]
        if gpu in node.fatal:
            return
        node.fatal.add(gpu)
        self.record(inv.GpusLost(self.now, node.name, (gpu,)))
        for job in list(self.jobs.values()):
            if job.state == "RUNNING" and job.placement is not None:
                if any(r.node == node.name and gpu in r.gpus for r in job.placement.replicas):
                    self.end(job, "GPU_FAILED", requeue=True, backoff=not self.shrinks(job))

    def do_mig(self, k: object) -> None:
        """An idle GPU (nothing on it, nothing releasing) starts switching MIG mode."""
        idle = []
        for n in self.nodes.values():
            if not n.up or n.model != MODELS[0][0]:
                continue
            busy = {g for gpus in n.releasing.values() for g in gpus} | n.fatal | set(n.switching)
            for j in self.jobs.values():
                if j.state == "RUNNING" and j.placement is not None:
                    busy |= {g for r in j.placement.replicas if r.node == n.name for g in r.gpus}
            idle += [(n, g) for g in range(n.gpus) if g not in busy]
        if idle:
            node, gpu = idle[int(k) % len(idle)]  # type: ignore[call-overload]
            node.switching[gpu] = self.now + self.scenario.switch_s
            # Recorded as it starts: the GPU is out of placement from now on, in its new mode once it is back.
            self.record(inv.MigMode(self.now, node.name, gpu, gpu not in node.mig))

    # -- the quiet end

    def drain(self, limit: float = 0.0) -> None:
        """The quiet point, then time until every job ended: nodes back up, releases confirmed as they come, no
        arrivals, no failures. Liveness is then judged on the history."""
        for node in self.nodes.values():
            if not node.up:
                self.do_up(list(n for n in self.nodes.values() if not n.up).index(node))
            if node.fatal:  # repaired
                self.record(inv.GpusBack(self.now, node.name, tuple(sorted(node.fatal))))
                node.fatal = set()
        self.decide()
        for node in self.nodes.values():  # MIG mode switches under way end first
            for gpu in list(node.switching):
                node.switching[gpu] = self.now
        self.happen()
        self.decide()
        owed = frozenset(
            j.spec.job
            for j in self.jobs.values()
            if j.state in ("PENDING", "RUNNING") and self.fits_empty(j.request, j.spec.queue)
        )
        self.record(inv.Quiet(self.now, owed))
        work = sum(j.work_left + j.spec.time_limit for j in self.jobs.values())
        limit = limit or self.now + 10 * work + 50 * (self.scenario.grace_s + self.scenario.min_runtime_s) + 600
        while self.now < limit and any(self.jobs[j].state in ("PENDING", "RUNNING") for j in owed):
            for node in self.nodes.values():
                for key in list(node.releasing):
                    del node.releasing[key]
                    self.record(inv.Released(self.now, key[0], key[1], node.name))
            self.decide()
            if any(node.releasing for node in self.nodes.values()):
                continue  # stopped in that decision: their nodes confirm next
            t = self.next_event()
            if t == math.inf:
                break  # nothing more will happen: what still waits never will (judged by the checker)
            self.do_advance(max(t, self.now + 1e-3) - self.now)

    def finish(self) -> list[inv.Violation]:
        if self.checker is not None:
            found = self.checker.finish()
            self.violations += found
        return self.violations


def holds_of(replicas: Iterable[ReplicaPlacement]) -> tuple[inv.Hold, ...]:
    """What replicas hold, as the invariant checks see it."""
    return tuple(inv.Hold(r.node, g, r.mig_mask, r.gpu_milli) for r in replicas for g in r.gpus)


def run(scenario: Scenario, *, claims: bool = True, drain: bool = True) -> World:
    """Play `scenario` in a new world until its end (or its first violation, in `world.violations`)."""
    world = World(scenario, claims=claims)
    try:
        world.decide()
        for action in scenario.actions:
            world.act(action)
        if drain:
            world.drain()
        world.finish()
    except StopRun:
        pass
    return world


__all__ = [
    "Action",
    "ClusterSpec",
    "JobSpec",
    "MODELS",
    "Scenario",
    "StopRun",
    "World",
    "format_actions",
    "parse_actions",
    "random_job",
    "random_scenario",
    "run",
    "shrink",
]


# FULL_MIG_MASK is re-exported for tests that build MIG holds.
_ = FULL_MIG_MASK
