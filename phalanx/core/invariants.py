"""The scheduling invariants, written once, as checks over a history of events. Pure: no I/O.

A scheduler is trusted for its invariants, not its features. These are the ones every combination of features
(preemption with its checkpoint handshake, the clean GPU handover, claims, EASY backfill, retries, quotas, MIG and
shares, failures) must keep, stated over what happened rather than over how the code decides, so that the same
checks judge the pure decision core driven by a model of the world (phalanx.testing.world, the randomized checker)
and the live scheduler's ledger (tests/e2e/test_chaos_invariants.py):

(a) exclusive, whole gangs. No GPU (nor MIG memory slice) is held by two attempts at once, counting the GPUs an
    ended attempt still holds until its node confirms its processes are gone; every attempt starts with all of its
    replicas' GPUs (a gang is whole or holds nothing).
(b) no priority inversion. While a preemptor's claim stands, no gang that may not use it (of equal or lower
    priority, or one of its own victims) starts on the GPUs it claims. And, whatever the mechanism: between a
    preemptor's first ask and its start, no gang of lower priority starts on a GPU that one of its victims held
    at the ask and that the preemptor then gets.
(c) no thrash. A gang is preempted at most once per preemptor while that preemptor waits (unless capacity was lost
    meanwhile: a node or GPU failed, a MIG mode changed, or a gang of higher priority started). Victims are asked
    only when stopping them can make the preemptor fit, counting the GPUs being released. A preemptor runs within
    its victims' grace period plus their release time (plus one decision's latency, `tick_s`), unless capacity was
    lost meanwhile, or it left the queue.
(d) liveness. After a quiet point (no arrivals, no failures from then on), every gang that fits the empty cluster
    ends by the end of the history. A blocked head's backfill reservation is never pushed back by a gang that
    started after it was made (unless capacity was lost or a gang of higher priority arrived).
(e) quotas. No queue runs above its nominal quota plus what it may borrow (its borrowing limit, and what its
    cohort lends); a reclaim only evicts a gang whose queue is borrowing.
(f) MIG and shares. No MIG instance on a GPU outside MIG mode, no whole-GPU job on one in it, no GPU's mode changed
    under an instance; no GPU's shares above one GPU.
(g) serving. A gang that may not preempt (a service's surge replica during a rolling update) never asks a gang to
    checkpoint and never claims capacity: it waits for a release instead (the deadlock of LeaderWorkerSet issues
    717 and 1050 is a surge that evicts, or waits on, what must go first).
(h) elastic gangs. An elastic gang (`--replicas MIN:MAX`) runs with whole replicas, between MIN and MAX of them, all
    of one attempt: it grows or shrinks only by a restart (a new attempt), never below MIN. A segmented one runs whole
    segments ((j)), its spares not counted as replicas ((i)).
(i) spares. A spare lies in its segment's domain, no rank is on a spare, and a swap never lets another gang take
    the slot (phalanx.core.spare_invariants).
(j) segments. Every attempt of a multi-level gang starts with each segment (replicas i*S .. i*S+S-1, ranks
    contiguous) inside one domain of its segment tier (placement.segments).

`check(events, ...)` returns the violations, each naming its invariant, the index of the event that broke it and
what happened; `Checker` takes the events one at a time (the randomized checker asserts after every step). The
events themselves are in phalanx.core.events (re-exported here).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .events import (  # re-exported (see __all__): callers name the events through this module
    Asked,
    CalledOff,
    ClaimEnded,
    ClaimMade,
    Cluster,
    Ended,
    Event,
    Finished,
    GpusBack,
    GpusLost,
    Hold,
    MigMode,
    NodeDown,
    NodeUp,
    Quiet,
    Released,
    Reserved,
    Started,
    Submitted,
)
from .placement.segments import default_segment_tier
from .quota import QueueSpec
from .spare_invariants import spare_violations

__all__ = [
    "Asked",
    "CalledOff",
    "Checker",
    "ClaimEnded",
    "ClaimMade",
    "Cluster",
    "Ended",
    "Event",
    "Finished",
    "GpusBack",
    "GpusLost",
    "Hold",
    "MigMode",
    "NodeDown",
    "NodeUp",
    "Quiet",
    "Released",
    "Reserved",
    "Started",
    "Submitted",
    "Violation",
    "check",
]


@dataclass(frozen=True, slots=True)
class Violation:
    """Invariant `invariant` ("a" to "f") broken at event `index` (time `t`): `what`."""

    invariant: str
    index: int
    t: float
    what: str

    def __str__(self) -> str:
        return f"({self.invariant}) at event {self.index}, t={self.t:g}: {self.what}"


# ---- the checks --------------------------------------------------------------------------------------------------


@dataclass
class _Job:
    priority: int = 0
    queue: str = "default"
    demand: tuple[float, float] = (0.0, 0.0)
    fits_empty: bool = True
    replicas: int = 1
    gpus_per_replica: int = 1
    attempt: int = 0  # the attempt running (0: none)
    flavor: str = ""
    holds: tuple[Hold, ...] = ()
    finished: bool = False
    submitted_at: float = 0.0
    preempts: bool = True
    segment: int = 0
    segment_tier: str = ""
    spares: int = 0
    ended: tuple[int, int, tuple[Hold, ...]] = (-1, 0, ())  # its last end: (event index, attempt, holds)
    min_replicas: int = 0


@dataclass
class _Episode:
    """A preemptor's wait: from its first ask until it starts or leaves the queue."""

    by: str
    since: float
    index: int
    victims: dict[str, int] = field(default_factory=dict)  # victim -> times asked in this episode
    last_ask: dict[str, float] = field(default_factory=dict)  # victim -> when last asked
    victim_gpus: set[tuple[str, int]] = field(default_factory=set)  # what they held at the asks
    lower_starts: list[tuple[int, float, str, frozenset[tuple[str, int]]]] = field(default_factory=list)
    waits_for: set[tuple[str, int]] = field(default_factory=set)  # victims' attempts not yet stopped
    pending_release: set[tuple[str, int, str]] = field(default_factory=set)  # (victim, attempt, node) held
    ready_at: float = -math.inf  # when the last victim stopped and its GPUs were released
    # Event indexes (events of one moment are ordered): the last capacity loss during the episode, its latest
    # ask, and each victim's latest ask.
    lost_index: int = -1
    asked_index: int = -1
    last_ask_index: dict[str, int] = field(default_factory=dict)


class Checker:
    """The invariants over events fed one at a time. `feed(event)` returns the violations that event reveals;
    `finish()` those only the end of the history reveals (liveness, a preemptor that never ran).

    `grace_s`: the victims' grace period; `tick_s`: how long after what it waits for a decision may come (0 for a
    model that decides after every event); `queues`: the quota queues (none: no quota checks)."""

    def __init__(
        self,
        *,
        grace_s: float = math.inf,
        tick_s: float = 0.0,
        queues: Mapping[str, QueueSpec] | None = None,
    ) -> None:
        self.grace_s, self.tick_s = grace_s, tick_s
        self.queues = dict(queues or {})
        self.index = -1
        self.t = -math.inf
        self.nodes: dict[str, int] = {}
        self.tiers: tuple[str, ...] = ()
        self.domains: Mapping[str, Mapping[str, str]] = {}  # tier -> node -> its domain of that tier
        self.down: set[str] = set()
        self.mig: set[tuple[str, int]] = set()
        self.jobs: dict[str, _Job] = {}
        # (node, gpu) -> holders: (job, attempt) -> Hold, ended attempts still held included
        self.gpus: dict[tuple[str, int], dict[tuple[str, int], Hold]] = defaultdict(dict)
        self.releasing: dict[tuple[str, int], set[str]] = {}  # ended attempt -> nodes it still holds
        self.attempt_holds: dict[tuple[str, int], tuple[Hold, ...]] = {}  # running or releasing attempts
        self.claims: dict[str, ClaimMade] = {}
        self.episodes: dict[str, _Episode] = {}  # preemptor -> its wait
        self.reservations: dict[str, tuple[float, float, int]] = {}  # head -> (made at, start, index)
        self.usage: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # (queue, flavor)
        self.quiet_at: float | None = None
        self.lost_index = -1  # the event of the last capacity loss (any)
        self.back_index = -1  # ... and of the last node back
        self.freed_index = -1  # ... and of the last attempt's end or release
        self.called_off_index = -1  # ... and of the last preemption called off
        self.asked_index = -1  # ... and of the last victim asked (its deadline is a new end to plan with)
        # (victim, preemptor) -> the event that last asked, and when
        self.asks: dict[tuple[str, str], tuple[int, float]] = {}
        self.asked_by: dict[tuple[str, int], str] = {}  # victim's attempt -> its (last) preemptor
        # job -> when it last ended by itself or was preempted by a gang of higher priority (c: not a cycle)
        self.ended_by: dict[str, tuple[int, str]] = {}  # job -> (event of its last end, its preemptor or "")
        self.starts: list[tuple[int, float, str]] = []  # (event index, t, job) of every start, in order
        self._fit_due: set[str] = set()  # preemptors asked for in the decision being fed
        self._reclaims: dict[str, list[str]] = {}  # ... and their victims asked for a reclaim
        self.out: list[Violation] = []

    # -- feeding

    def feed(self, event: Event) -> list[Violation]:
        mark = len(self.out)
        if self._fit_due and not (isinstance(event, Asked | ClaimMade) and event.t == self.t):
            self._check_fits()  # after every ask of one decision
        self.index += 1
        self.t = event.t
        handler = getattr(self, "_on_" + type(event).__name__)
        handler(event)
        return self.out[mark:]

    def feed_all(self, events: Iterable[Event]) -> list[Violation]:
        for e in events:
            self.feed(e)
        return self.out

    def _bad(self, invariant: str, what: str) -> None:
        self.out.append(Violation(invariant, self.index, self.t, what))

    def _lost(self) -> None:
        self.lost_index = self.index
        for ep in self.episodes.values():
            ep.lost_index = self.index

    # -- handlers

    def _on_Cluster(self, e: Cluster) -> None:
        self.nodes = dict(e.nodes)
        self.mig = set(e.mig)
        self.tiers, self.domains = tuple(e.tiers), e.domains

    def _on_Submitted(self, e: Submitted) -> None:
        self.jobs[e.job] = _Job(
            e.priority,
            e.queue,
            e.demand,
            e.fits_empty,
            e.replicas,
            e.gpus_per_replica,
            submitted_at=e.t,
            preempts=e.preempts,
            segment=e.segment,
            segment_tier=e.segment_tier,
            spares=e.spares,
            min_replicas=e.min_replicas,
        )
        if self.quiet_at is not None:
            self._bad("d", f"job {e.job} arrived after the quiet point")

    def _on_Started(self, e: Started) -> None:
        job = self.jobs.get(e.job)
        if job is None:
            self._bad("a", f"job {e.job} started without being submitted")
            return
        if job.attempt:
            self._bad("a", f"job {e.job} started attempt {e.attempt} while attempt {job.attempt} still runs")
        whole = [(h.node, h.gpu) for h in e.holds if h.whole]
        if len(e.holds) != e.expected or len(set(whole)) != len(whole):
            self._bad("a", f"job {e.job} attempt {e.attempt} started with {len(e.holds)} of its {e.expected} GPUs")
        if job.min_replicas:
            self._check_elastic(e, job)
        key = (e.job, e.attempt)
        mine = frozenset((h.node, h.gpu) for h in e.holds if h.whole)  # (b, mechanism-free: whole GPUs)
        for h in e.holds:
            where = (h.node, h.gpu)
            if h.node in self.down:
                self._bad("a", f"job {e.job} started on node {h.node}, which is down")
            if where not in self._known():
                self._bad("a", f"job {e.job} holds GPU {h.gpu} of {h.node}, which does not exist")
            # (f) MIG mode
            if h.mig_mask and where not in self.mig:
                self._bad("f", f"job {e.job} got a MIG instance on GPU {h.gpu} of {h.node}, not in MIG mode")
            if not h.mig_mask and where in self.mig:
                self._bad("f", f"job {e.job} got GPU {h.gpu} of {h.node} (in MIG mode) as a whole GPU or share")
            # (a) exclusive (and (f) shares)
            holders = self.gpus[where]
            for (other, attempt), held in holders.items():
                if other == e.job and attempt == e.attempt:
                    continue
                clash = (
                    h.whole
                    or held.whole
                    or bool(h.mig_mask and held.mig_mask and h.mig_mask & held.mig_mask)
                    or bool(h.mig_mask) != bool(held.mig_mask)
                )
                if clash:
                    state = "ended, still releasing" if (other, attempt) in self.releasing else "running"
                    self._bad(
                        "a",
                        f"GPU {h.gpu} of {h.node} given to job {e.job} while job {other} attempt {attempt} "
                        f"({state}) holds it",
                    )
            if h.milli:
                total = h.milli + sum(x.milli for k, x in holders.items() if k != key)
                if total > 1000:
                    self._bad("f", f"GPU {h.gpu} of {h.node} shared above one GPU ({total}/1000)")
            holders[key] = h
        job.attempt, job.holds, job.flavor = e.attempt, e.holds, e.flavor
        self.attempt_holds[key] = e.holds
        if job.segment > 0 and e.replica_nodes:
            self._check_segments(e, job)
        if job.spares or e.swap_of:
            running = len(e.replica_nodes) if job.min_replicas and e.replica_nodes else job.replicas  # (h: its size)
            shape = (running, job.gpus_per_replica, job.segment, job.segment_tier, job.spares)
            for what in spare_violations(e, shape, self.domains, self.tiers, self.down, job.ended, self.index):
                self._bad("i", what)
        # (b) claims: no start on claimed capacity by a gang that may not use it
        for claim in self.claims.values():
            if claim.job == e.job:
                continue
            claimant = self.jobs.get(claim.job)
            cp = claimant.priority if claimant else 0
            if job.priority > cp and e.job not in claim.victims:
                continue
            overlap = self._claimed_overlap(claim, e.holds)
            if overlap is not None:
                node, gpu = overlap
                self._bad(
                    "b",
                    f"job {e.job} (priority {job.priority}) started on GPU {gpu} of {node}, claimed by "
                    f"preemptor {claim.job} (priority {cp})"
                    + (" whose victim it was" if e.job in claim.victims else ""),
                )
        # (b), mechanism-free: remembered per episode, judged when the preemptor starts
        for ep in self.episodes.values():
            # (Judged only while no capacity was lost in the episode: a loss may void its plan and end its claim.)
            if ep.by != e.job and job.priority < self._priority(ep.by) and ep.lost_index < ep.index:
                if mine & ep.victim_gpus:  # on GPUs its victims held (asked before this start)
                    ep.lower_starts.append((self.index, e.t, e.job, mine & ep.victim_gpus))
            if job.priority > self._priority(ep.by):
                ep.lost_index = self.index  # a gang of higher priority took capacity meanwhile
        mine_ep = self.episodes.pop(e.job, None)
        if mine_ep is not None:
            self._judge_episode(mine_ep, mine)
        # (e) quota
        if self.queues:
            g, s = job.demand
            use = self.usage[(job.queue, e.flavor)]
            use[0] += g
            use[1] += s
            self._check_quota(job.queue, e.flavor)
        self.starts.append((self.index, e.t, e.job))

    def _check_segments(self, e: Started, job: _Job) -> None:
        """(j) each segment of S contiguous ranks inside one domain of the gang's segment tier."""
        s, nodes = job.segment, e.replica_nodes
        tier = job.segment_tier or default_segment_tier(self.tiers)
        if len(nodes) % s:
            self._bad("j", f"job {e.job} started {len(nodes)} replicas, not whole segments of {s}")
            return
        where = self.domains.get(tier)
        if where is None:
            return  # "node" is checked by the nodes themselves below; "cluster" holds everything
        for i in range(0, len(nodes), s):
            got = {where.get(node, "") for node in nodes[i : i + s]}
            if len(got) != 1 or "" in got:
                self._bad(
                    "j",
                    f"job {e.job} attempt {e.attempt}: segment {i // s} (ranks {i}-{i + s - 1}) spans {tier} "
                    f"domains {sorted(got)}",
                )

    def _check_elastic(self, e: Started, job: _Job) -> None:
        """(h) an elastic gang's attempt holds whole replicas, between its minimum and its maximum of them (and, as
        for every gang, only GPUs of that one attempt: (a))."""
        ranks = len(e.holds) - len(e.spare_holds)  # (its spares kept in the domain are no ranks: invariant i)
        replicas, rest = divmod(ranks, max(1, job.gpus_per_replica))
        if rest or not job.min_replicas <= replicas <= job.replicas:
            self._bad(
                "h",
                f"elastic job {e.job} attempt {e.attempt} started with {ranks} GPUs for its ranks: not "
                f"{job.min_replicas} to {job.replicas} whole replicas of {job.gpus_per_replica} GPUs",
            )

    def _claimed_overlap(self, claim: ClaimMade, holds: tuple[Hold, ...]) -> tuple[str, int] | None:
        """The GPU where `holds` (just taken) eat into what `claim` claims: a whole GPU it claims, a MIG slice of
        an instance it claims, or share capacity that its shares need (the GPU's holders, the claimant's own not
        counted, now take more than 1000 minus the claimed shares)."""
        for h in holds:
            for c in claim.holds:
                if (c.node, c.gpu) != (h.node, h.gpu):
                    continue
                if c.whole or h.whole or (c.mig_mask and h.mig_mask and c.mig_mask & h.mig_mask):
                    return h.node, h.gpu
                if c.milli and h.milli:
                    held = sum(x.milli for (j, _), x in self.gpus.get((h.node, h.gpu), {}).items() if j != claim.job)
                    claimed = sum(x.milli for x in claim.holds if (x.node, x.gpu) == (h.node, h.gpu))
                    if held + claimed > 1000:
                        return h.node, h.gpu
        return None

    def _judge_episode(self, ep: _Episode, got: frozenset[tuple[str, int]]) -> None:
        # Mechanism-free (b), for an episode the cluster did not change under (no loss, nothing back): a change may
        # rightly move the preemptor's plan onto GPUs it had left to others.
        clean = ep.lost_index < ep.index and self.back_index < ep.index
        for index, t, other, gpus in ep.lower_starts if clean else ():
            if gpus & got:
                node, gpu = min(gpus & got)
                self._bad(
                    "b",
                    f"job {other} (priority {self._priority(other)}) started at t={t:g} (event {index}) on GPU "
                    f"{gpu} of {node}, which preemptor {ep.by} (priority {self._priority(ep.by)}) freed and then got",
                )
        # (c) it runs within its victims' grace period plus their release time
        if ep.waits_for or ep.pending_release:
            return  # it started before its victims were gone (elsewhere): nothing to hold against it
        if self.t > ep.ready_at + self.tick_s + 1e-9 and ep.lost_index < ep.asked_index:
            self._bad(
                "c",
                f"preemptor {ep.by} started {self.t - ep.ready_at:g}s after its victims were stopped and "
                f"released (at t={ep.ready_at:g})",
            )

    def _on_Ended(self, e: Ended) -> None:
        self.freed_index = self.index
        job = self.jobs.get(e.job)
        if job is None or job.attempt != e.attempt:
            self._bad("a", f"attempt {e.attempt} of job {e.job} ended but was not running")
            return
        key = (e.job, e.attempt)
        # Its end, by itself or by a third gang's preemption, and by whom it was preempted (c: a cycle is a
        # preemptor preempted by its own victim in between)
        self.ended_by[e.job] = (self.index, self.asked_by.get(key, "") if e.outcome == "PREEMPTED" else "")
        held = set(e.held)
        for h in job.holds:
            if h.node not in held:
                self.gpus[(h.node, h.gpu)].pop(key, None)
        if held:
            self.releasing[key] = held
        else:
            self.attempt_holds.pop(key, None)
        if self.queues:
            g, s = job.demand
            use = self.usage[(job.queue, job.flavor)]
            use[0] -= g
            use[1] -= s
        job.ended = (self.index, e.attempt, job.holds)
        job.attempt, job.holds = 0, ()
        for ep in self.episodes.values():
            if key in ep.waits_for:
                ep.waits_for.discard(key)
                if e.outcome == "PREEMPTED" and self.grace_s < math.inf:
                    asked = ep.last_ask.get(e.job, ep.since)
                    if e.t > asked + self.grace_s + self.tick_s + 1e-9:
                        self._bad(
                            "c",
                            f"victim {e.job} stopped {e.t - asked:g}s after it was asked for {ep.by} (grace "
                            f"period {self.grace_s:g}s)",
                        )
                for node in held:
                    ep.pending_release.add((e.job, e.attempt, node))
                if not ep.waits_for and not ep.pending_release:
                    ep.ready_at = e.t

    def _on_Released(self, e: Released) -> None:
        self.freed_index = self.index
        key = (e.job, e.attempt)
        nodes = self.releasing.get(key)
        if nodes is None or e.node not in nodes:
            return  # already free (a late or repeated confirmation)
        nodes.discard(e.node)
        for h in self.attempt_holds.get(key, ()):
            if h.node == e.node:
                self.gpus[(h.node, h.gpu)].pop(key, None)
        if not nodes:
            del self.releasing[key]
            self.attempt_holds.pop(key, None)
        for ep in self.episodes.values():
            if (e.job, e.attempt, e.node) in ep.pending_release:
                ep.pending_release.discard((e.job, e.attempt, e.node))
                if not ep.waits_for and not ep.pending_release:
                    ep.ready_at = e.t

    def _on_Finished(self, e: Finished) -> None:
        job = self.jobs.get(e.job)
        if job is not None:
            job.finished = True
        self.episodes.pop(e.job, None)  # a preemptor cancelled: nothing more is owed to it
        self.reservations.pop(e.job, None)

    def _on_CalledOff(self, e: CalledOff) -> None:
        self.called_off_index = self.index

    def _on_Asked(self, e: Asked) -> None:
        self.asked_index = self.index
        if e.reclaim:
            # A queue takes back quota its cohort lent: a borrowing preemptor elsewhere may have counted on that
            # quota to run once its victims stop. For its time bound that is capacity lost.
            for other in self.episodes.values():
                if other.by != e.by:
                    other.lost_index = self.index
        victim = self.jobs.get(e.victim)
        by = self.jobs.get(e.by)
        if by is not None and not by.preempts:
            self._bad("g", f"job {e.by} may not preempt (a surge replica) but asked {e.victim} to checkpoint")
        if victim is None or victim.attempt != e.attempt:
            self._bad("c", f"job {e.victim} asked to stop for {e.by} while not running")
            return
        ep = self.episodes.get(e.by)
        if ep is None:
            ep = self.episodes[e.by] = _Episode(e.by, e.t, self.index)
        n = ep.victims.get(e.victim, 0)
        if n and ep.lost_index < ep.last_ask_index.get(e.victim, ep.index):
            self._bad("c", f"job {e.victim} preempted again by {e.by} (time {n + 1}) while {e.by} still waits")
        # Across the preemptor's waits: once more only if, since the last time, capacity was lost, or the
        # preemptor ended by itself (finished, failed, cancelled) or was preempted by a third gang (a cascade).
        # Otherwise the victim preempted its preemptor in between: the two take turns, a preemption cycle.
        before = self.asks.get((e.victim, e.by))
        if before is not None and not n:
            ended, by_whom = self.ended_by.get(e.by, (-1, ""))
            excused = self.lost_index > before[0] or (ended > before[0] and by_whom != e.victim)
            if not excused:
                self._bad(
                    "c",
                    f"job {e.victim} preempted by {e.by} again (last at t={before[1]:g}), after it preempted "
                    f"{e.by} in turn: a preemption cycle",
                )
        self.asks[(e.victim, e.by)] = (self.index, e.t)
        self.asked_by[(e.victim, e.attempt)] = e.by
        ep.victims[e.victim] = n + 1
        ep.last_ask[e.victim] = e.t
        ep.last_ask_index[e.victim] = ep.asked_index = self.index
        ep.waits_for.add((e.victim, e.attempt))
        ep.victim_gpus |= {(h.node, h.gpu) for h in victim.holds if h.whole}
        # What is being released now may be part of its plan too: it waits for that as for its victims.
        ep.pending_release |= {(j, a, node) for (j, a), nodes in self.releasing.items() for node in nodes}
        # (e) a reclaim evicts only a borrowing queue's gang (and, judged with the decision's other asks, takes
        # back no more than it borrowed)
        if e.reclaim and self.queues:
            self._reclaims.setdefault(e.by, []).append(e.victim)
            spec = self.queues.get(victim.queue)
            quota = spec.quotas.get(victim.flavor) if spec else None
            g, s = self.usage[(victim.queue, victim.flavor)]
            if quota is None or (g <= quota.gpus + 1e-9 and s <= quota.mig_slices + 1e-9):
                self._bad(
                    "e",
                    f"job {e.victim} of queue {victim.queue!r} reclaimed for {e.by} although its queue is not "
                    "borrowing",
                )
        # (c) asked only when stopping the victims can make it fit, counting what is being released: judged once
        # every ask of this decision is in
        if by is not None:
            self._fit_due.add(e.by)

    def _check_fits(self) -> None:
        """A necessary condition for each preemptor asked for: on the nodes up, the GPUs free, being released or
        held by its victims hold enough replicas of its size (whole-GPU gangs; partial GPUs are not counted)."""
        due, self._fit_due = self._fit_due, set()
        reclaims, self._reclaims = self._reclaims, {}
        for by_id, victims in sorted(reclaims.items()):
            by_queue: dict[tuple[str, str], list[float]] = {}
            for v in victims:
                job = self.jobs[v]
                by_queue.setdefault((job.queue, job.flavor), []).append(job.demand[0] + job.demand[1])
            for (queue, flavor), sizes in sorted(by_queue.items()):
                spec = self.queues.get(queue)
                quota = spec.quotas.get(flavor) if spec else None
                if quota is None:
                    continue
                g, sl = self.usage[(queue, flavor)]
                borrowed = max(g - quota.gpus, 0.0) + max(sl - quota.mig_slices, 0.0)
                if sum(sizes) - max(sizes) >= borrowed - 1e-9:
                    self._bad(
                        "e",
                        f"{by_id} reclaimed {sum(sizes):g} GPU(s) and slices from queue {queue!r}, which "
                        f"borrowed {borrowed:g}: more than the last gang needed to end its borrowing",
                    )
        for by_id in sorted(due):
            by, ep = self.jobs.get(by_id), self.episodes.get(by_id)
            whole = by is not None and by.demand == (float(by.replicas * by.gpus_per_replica), 0.0)
            if by is None or ep is None or by.gpus_per_replica <= 0 or not whole:
                continue  # partial GPUs (MIG instances, shares): counting whole GPUs says nothing
            slots = 0
            for node, count in self.nodes.items():
                if node in self.down:
                    continue
                avail = 0
                for gpu in range(count):
                    holders = self.gpus.get((node, gpu))
                    if (node, gpu) not in self.mig and (
                        not holders or all(j in ep.victims or (j, a) in self.releasing for j, a in holders)
                    ):
                        avail += 1
                slots += avail // by.gpus_per_replica
            need = by.min_replicas or by.replicas  # an elastic preemptor starts with its minimum
            if slots < need:
                self._bad(
                    "c",
                    f"victims asked for {by_id} although even with them and every releasing GPU gone it "
                    f"would fit {slots} of its {need} replicas" + (" (its minimum)" if by.min_replicas else ""),
                )

    def _on_ClaimMade(self, e: ClaimMade) -> None:
        claimant = self.jobs.get(e.job)
        if claimant is not None and not claimant.preempts:
            self._bad("g", f"job {e.job} may not preempt (a surge replica) but claimed capacity")
        self.claims[e.job] = e

    def _on_ClaimEnded(self, e: ClaimEnded) -> None:
        self.claims.pop(e.job, None)

    def _on_NodeDown(self, e: NodeDown) -> None:
        self.down.add(e.node)
        self._lost()
        if self.quiet_at is not None:
            self._bad("d", f"node {e.node} failed after the quiet point")

    def _on_NodeUp(self, e: NodeUp) -> None:
        self.down.discard(e.node)
        self.back_index = self.index
        # Its agent restarted: nothing of the ended attempts runs there any more.
        for key, nodes in list(self.releasing.items()):
            if e.node in nodes:
                self._on_Released(Released(e.t, key[0], key[1], e.node))

    def _on_GpusLost(self, e: GpusLost) -> None:
        self._lost()
        if self.quiet_at is not None:
            self._bad("d", f"GPUs of {e.node} failed after the quiet point")

    def _on_GpusBack(self, e: GpusBack) -> None:
        self.back_index = self.index

    def _on_MigMode(self, e: MigMode) -> None:
        where = (e.node, e.gpu)
        if any(h.mig_mask or h.milli or h.whole for h in self.gpus.get(where, {}).values()):
            self._bad("f", f"GPU {e.gpu} of {e.node} changed MIG mode while held")
        if e.on:
            self.mig.add(where)
        else:
            self.mig.discard(where)
        self._lost()

    def _on_Reserved(self, e: Reserved) -> None:
        before = self.reservations.get(e.job)
        self.reservations = {e.job: (e.t, e.start, self.index)} if e.job else {}
        if before is None:
            return
        made, start, made_index = before
        if math.isinf(start) or e.start <= max(start, e.t) + 1e-6:
            return
        # Capacity lost, or gained (a node or GPU back, an attempt ended, GPUs released): placement is a bounded
        # search, and the reservation waits for a compact shape, so more free capacity may move its witness to a
        # better shape that comes later. Only a push with no such change in between is a backfill's doing.
        # A victim asked to stop: its deadline is an end the reservation plans with, which may move its witness to
        # a more compact shape that comes later. A preemption called off: the deadline it counted on no longer holds.
        if (
            max(self.lost_index, self.back_index, self.freed_index, self.called_off_index, self.asked_index)
            > made_index
        ):
            return
        # Gangs before the head in queue order (higher priority, or equal and older; with quotas, equal priority in
        # another queue may come first by fair share) are served first: they may push it back (priorities win). A
        # gang behind it that started since, with none before it, is a backfill that did.
        head = self.jobs.get(e.job)
        if head is None:
            return
        behind = ""
        for index, t, other in reversed(self.starts):
            if index < made_index:
                break
            job = self.jobs.get(other)
            if job is None or other == e.job:
                continue
            if job.priority < head.priority or (
                job.priority == head.priority
                and job.submitted_at > head.submitted_at
                and (job.queue == head.queue or not self.queues)
            ):
                behind = behind or f"job {other}, behind it in the queue, started at t={t:g}"
            else:
                return
        if behind:
            self._bad(
                "d",
                f"head {e.job}'s reservation moved from t={start:g} to t={e.start:g} after {behind} "
                f"(reservation made at t={made:g})",
            )

    def _on_Quiet(self, e: Quiet) -> None:
        self.quiet_at = e.t
        if e.owed is not None:
            for job_id, job in self.jobs.items():
                job.fits_empty = job_id in e.owed

    # -- helpers

    def _priority(self, job_id: str) -> int:
        job = self.jobs.get(job_id)
        return job.priority if job else 0

    def _known(self) -> set[tuple[str, int]]:
        return {(n, g) for n, count in self.nodes.items() for g in range(count)}

    def _check_quota(self, queue: str, flavor: str) -> None:
        spec = self.queues.get(queue)
        if spec is None or spec.unlimited:
            return
        quota = spec.quotas.get(flavor)
        g, s = self.usage[(queue, flavor)]
        if quota is None:
            self._bad("e", f"queue {queue!r} runs a gang under flavor {flavor!r}, which it has no quota for")
            return
        lend_g = lend_s = 0.0
        if spec.cohort:
            for other in self.queues.values():
                if other.name != queue and other.cohort == spec.cohort and flavor in other.quotas:
                    q = other.quotas[flavor]
                    og, os_ = self.usage[(other.name, flavor)]
                    lend_g += max(0.0, q.gpus - og)
                    lend_s += max(0.0, q.mig_slices - os_)
        limit = math.inf if quota.borrow_limit is None else quota.borrow_limit
        over_g, over_s = g - quota.gpus, s - quota.mig_slices
        if over_g > min(limit, lend_g) + 1e-9 or over_s > lend_s + 1e-9:
            self._bad(
                "e",
                f"queue {queue!r} runs {g:g} GPU(s) and {s:g} slice(s) of {flavor!r}: above its nominal "
                f"{quota.gpus:g}/{quota.mig_slices:g} plus what it may borrow",
            )

    # -- the end

    def finish(self) -> list[Violation]:
        """What only the end of the history shows: after a quiet point, gangs owed liveness that never ended, and
        preemptors that never ran though their victims were gone and no capacity was lost."""
        mark = len(self.out)
        if self._fit_due:
            self._check_fits()
        self.index += 1
        if self.quiet_at is not None:
            for job_id, owed in self.jobs.items():
                if owed.fits_empty and not owed.finished:
                    self._bad("d", f"job {job_id} fits the empty cluster but had not ended by t={self.t:g}")
        for ep in self.episodes.values():
            if ep.waits_for or ep.pending_release:
                continue
            if self.t > ep.ready_at + self.tick_s + 1e-9 and ep.lost_index < ep.asked_index:
                job = self.jobs.get(ep.by)
                if job is not None and not job.finished:
                    self._bad(
                        "c",
                        f"preemptor {ep.by} never ran, though its victims were stopped and released at "
                        f"t={ep.ready_at:g}",
                    )
        return self.out[mark:]


def check(
    events: Sequence[Event],
    *,
    grace_s: float = math.inf,
    tick_s: float = 0.0,
    queues: Mapping[str, QueueSpec] | None = None,
) -> list[Violation]:
    """Every violation of the invariants in `events` (in time order), the end of the history included."""
    checker = Checker(grace_s=grace_s, tick_s=tick_s, queues=queues)
    checker.feed_all(events)
    checker.finish()
    return checker.out
