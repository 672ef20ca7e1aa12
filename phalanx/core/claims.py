"""A preemptor's claim on the capacity its victims free. Pure: no I/O.

Preemption stops whole gangs so that a higher-priority gang fits. Between the ask and the moment the preemptor
runs, the victims checkpoint (their grace period), stop, and their nodes confirm, one by one and at their own pace,
that the old processes are gone (the clean GPU handover). Without a claim, whatever comes free first is fair game
for any gang the pass reaches: a requeued victim with no time limit that fits on the first node freed starts again
there, the preemptor keeps waiting, and once that victim is past its minimum runtime it is preempted a second
time (a preemption loop; Kueue issue 13662 is the same bug).

A claim is the preemptor's hold on exactly the capacity its preemption planned for it (the placement
`choose_victims` found: the victims' GPUs it needs and the free GPUs beside them), recorded in the ledger like
Kubernetes' nominated node, so that it survives partial and late releases, decisions and a scheduler failover.
While it stands, the claimed capacity, as it comes free, is hidden from every gang that may not use it:
- the claimant uses it;
- a gang of strictly higher priority may use it (priorities win), unless it is one of the claim's own victims (a
  quota reclaim may evict a gang that outranks the reclaimer: it must not take the capacity straight back);
- nobody else: no gang of equal or lower priority starts on it, not even by backfill.

A claim ends when its gang is placed, leaves the queue (cancelled, finished), or can no longer fit where it
claimed (a claimed node is lost, drained or unhealthy, a claimed GPU turned unusable): then the preemptor decides
afresh, and may preempt again for other capacity. See `decide` for where claims are made and ended.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .capacity import ClusterCapacity
from .mig import MEDIA_BIT
from .model import GangRequest, NodeCapacity, Placement, ReplicaPlacement

__all__ = ["Claim", "ClaimShield", "merged", "outside", "with_claimed"]


@dataclass(frozen=True, slots=True)
class Claim:
    """`job` (of `priority`) claims `replicas`: where it goes once its `victims` are gone. `since`: when it was
    made (the first ask of this preemption)."""

    job: str
    priority: int
    replicas: tuple[ReplicaPlacement, ...]
    victims: tuple[str, ...] = ()
    since: float = 0.0
    # With quotas: the queue and flavor it runs under there. A scheduling pass charges its demand to them until
    # its turn, so that no gang served before it takes the quota it needs either (see backfill).
    queue: str = ""
    flavor: str = ""

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.node for r in self.replicas))

    @property
    def gpus(self) -> int:
        """Whole GPUs claimed (a MIG instance or a share counts as its GPU)."""
        return sum(len(r.gpus) for r in self.replicas)

    def gpu_set(self) -> frozenset[tuple[str, int]]:
        """(node, GPU index) of every GPU it claims (wholly or in part)."""
        return frozenset((r.node, g) for r in self.replicas for g in r.gpus)

    def may_use(self, job_id: str, priority: int) -> bool:
        """Whether a gang may be placed on this claim's capacity (see the module docstring)."""
        return job_id == self.job or (priority > self.priority and job_id not in self.victims)

    @classmethod
    def of(
        cls,
        job: str,
        priority: int,
        placement: Placement,
        victims: Iterable[str],
        since: float,
        queue: str = "",
        flavor: str = "",
        freed: Iterable[ReplicaPlacement] = (),
    ) -> Claim:
        """The claim on `placement` (where it goes) and on what its victims free besides (`freed`: their replicas),
        so that no gang it outranks starts on a victim's GPU it may need should its plan change (a victim's node
        slow to confirm its release while another victim's GPUs are free already)."""
        replicas = merged(placement.replicas, freed)
        return cls(job, priority, replicas, tuple(dict.fromkeys(victims)), since, queue, flavor)


def merged(primary: Iterable[ReplicaPlacement], extra: Iterable[ReplicaPlacement]) -> tuple[ReplicaPlacement, ...]:
    """`primary`, then what `extra` holds that `primary` does not (a whole GPU once; a partial replica whose GPU is
    not in `primary`)."""
    out = list(primary)
    taken = {(r.node, g) for r in out for g in r.gpus}
    for r in extra:
        if r.mig_profile or r.gpu_milli:
            if (r.node, r.gpus[0]) not in taken:
                out.append(r)
                taken.add((r.node, r.gpus[0]))
            continue
        gpus = tuple(g for g in r.gpus if (r.node, g) not in taken)
        if gpus:
            out.append(ReplicaPlacement(r.replica, r.node, gpus))
            taken.update((r.node, g) for g in gpus)
    return tuple(out)


class _Hidden:
    """What hiding took out of the capacity for one claimed replica, to give back exactly."""

    __slots__ = ("rep", "whole", "partial", "use", "fillers")

    def __init__(self, rep: ReplicaPlacement) -> None:
        self.rep = rep
        self.whole: set[int] = set()
        self.partial = False
        self.use = False
        # Shares that fill a claimed whole GPU which a gang of higher priority split meanwhile (its shares may be
        # used by those who may use the claim, not by others)
        self.fillers: list[ReplicaPlacement] = []


class ClaimShield:
    """Hides claimed capacity from the gangs that may not use it, on the capacity index itself, and shows it again.

    `for_request(request)` leaves the index as `request` may see it: the claims it may use shown, the others hidden
    (whatever of their capacity is free at that moment is taken out; capacity that comes free later, a victim
    stopped in the same decision, is taken at the next call). Hiding remembers what it took, so showing gives back
    exactly that; `restore()` shows everything (the index is then as it was, plus what placements reserved
    meanwhile). `drop(job)` shows a claim for good (its gang was placed). Cheap when there are no claims: every
    call returns at once."""

    __slots__ = ("cap", "claims", "enabled", "_hidden", "_last")

    def __init__(self, cap: ClusterCapacity, claims: Iterable[Claim], enabled: bool = True) -> None:
        self.cap = cap
        self.enabled = enabled  # off: claims are neither kept nor made (DecideConfig.claims)
        self.claims: dict[str, Claim] = {c.job: c for c in claims}
        self._hidden: dict[str, list[_Hidden]] = {}
        # The claims shown at the last call, while nothing but placements changed the index since: a pass's gangs
        # come in priority order, so most see what the one before saw and cost a comparison.
        self._last: frozenset[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.claims)

    def owns(self, job_id: str) -> bool:
        """Whether `job_id` has a claim (placing it shows its own)."""
        return job_id in self.claims

    def for_request(self, request: GangRequest) -> None:
        self.for_job(request.job_id, request.priority)

    def for_job(self, job_id: str, priority: int) -> None:
        if not self.claims:
            return
        shown = frozenset(c.job for c in self.claims.values() if c.may_use(job_id, priority))
        if shown == self._last:
            return
        for claim in self.claims.values():
            if claim.job in shown:
                self._show(claim.job)
            else:
                self._hide(claim)
        self._last = shown

    def hidden_from(self, job_id: str, priority: int) -> list[Claim]:
        """The claims a gang may not use."""
        return [c for c in self.claims.values() if not c.may_use(job_id, priority)]

    def add(self, claim: Claim) -> None:
        """A new claim, or one that replaces the gang's claim (shown until the next `for_job`)."""
        self._show(claim.job)
        self.claims[claim.job] = claim
        self._last = None

    def drop(self, job_id: str) -> None:
        self._show(job_id)
        self.claims.pop(job_id, None)
        self._last = None

    def restore(self) -> None:
        """Show every claim (call it before anything but a placement changes the index: a release)."""
        for job_id in list(self._hidden):
            self._show(job_id)
        self._last = None

    def _hide(self, claim: Claim) -> None:
        cap = self.cap
        hidden = self._hidden.get(claim.job)
        if hidden is None:
            hidden = self._hidden[claim.job] = [_Hidden(rep) for rep in claim.replicas]
        for h in hidden:
            rep = h.rep
            node = cap.nodes.get(rep.node)
            if node is None:
                continue
            if rep.mig_profile:
                # A claimed MIG instance: whatever of its memory slices is free is hidden as it comes free (a victim
                # may still hold some), in contiguous runs.
                (gpu,) = rep.gpus
                want = rep.mig_mask & ~MEDIA_BIT
                taken = sum(f.mig_mask for f in h.fillers)
                free = want & ~node.mig.get(gpu, 0) & ~taken if gpu in node.mig_gpus else 0
                for start, size in _runs(free):
                    filler = ReplicaPlacement(rep.replica, rep.node, (gpu,), "claimed", start, size)
                    cap.take_partial(filler)
                    h.fillers.append(filler)
                done = taken | free == want
            elif rep.gpu_milli:
                if not h.partial and _partial_free(node, rep):
                    cap.take_partial(rep)
                    h.partial = True
                done = h.partial
            else:
                more = node.free.intersection(rep.gpus)
                if more:
                    cap.take(rep.node, more)
                    h.whole |= more
                for gpu in rep.gpus:
                    used = node.milli.get(gpu)
                    if gpu not in h.whole and used is not None and used < 1000 and gpu not in node.mig_gpus:
                        filler = ReplicaPlacement(rep.replica, rep.node, (gpu,), gpu_milli=1000 - used)
                        cap.take_partial(filler)
                        h.fillers.append(filler)
                done = len(h.whole) == len(rep.gpus)
            # Its host resources are hidden with its GPUs once they are all free (until then a victim holds them).
            if done and not h.use and (rep.cpu_milli or rep.memory):
                cap.take_use(rep.node, rep.cpu_milli, rep.memory)
                h.use = True

    def _show(self, job_id: str) -> None:
        hidden = self._hidden.pop(job_id, None)
        if not hidden:
            return
        cap = self.cap
        for h in hidden:
            rep = h.rep
            if h.partial:
                cap.release_partial(rep)
            elif h.whole:
                cap.release(rep.node, h.whole)
            for filler in h.fillers:
                cap.release_partial(filler)
            if h.use:
                cap.release_use(rep.node, rep.cpu_milli, rep.memory)


def _runs(mask: int) -> list[tuple[int, int]]:
    """(start, size) of each run of set bits of `mask`, lowest first."""
    out, i = [], 0
    while mask >> i:
        if mask >> i & 1:
            start = i
            while mask >> i & 1:
                i += 1
            out.append((start, i - start))
        else:
            i += 1
    return out


def _partial_free(node: NodeCapacity, rep: ReplicaPlacement) -> bool:
    """Whether a claimed MIG instance or share is free on the node as it is now."""
    (gpu,) = rep.gpus
    if rep.mig_profile:
        if gpu not in node.mig_gpus:
            return False
        return not (node.mig.get(gpu, 0) & rep.mig_mask)
    if gpu in node.mig_gpus or (gpu not in node.free and gpu not in node.milli):
        return False
    return node.milli.get(gpu, 0) + rep.gpu_milli <= 1000


def outside(placements: Sequence[Placement], claims: Collection[Claim]) -> list[Placement]:
    """`placements` (of GPUs being released) without the GPUs of `claims`: what a gang those claims are hidden from
    may count on as coming free."""
    if not claims:
        return list(placements)
    taken: dict[str, set[int]] = {}
    for c in claims:
        for r in c.replicas:
            taken.setdefault(r.node, set()).update(r.gpus)
    out = []
    for p in placements:
        reps = tuple(
            ReplicaPlacement(r.replica, r.node, tuple(g for g in r.gpus if g not in taken.get(r.node, ())))
            for r in p.replicas
            if not (r.mig_profile or r.gpu_milli)
        )
        reps = tuple(r for r in reps if r.gpus)
        if reps:
            out.append(Placement(p.job_id, reps, p.tier, p.domains, p.score, p.reason))
    return out


def with_claimed(
    unusable: Mapping[str, Collection[int]] | None, claims: Collection[Claim]
) -> Mapping[str, Collection[int]]:
    """`unusable` plus every GPU of `claims`: what a search that releases running gangs (a preemption, a backfill
    reservation) must keep out of a gang those claims are hidden from. Hiding takes only what is free; a search
    that frees a claimed GPU by releasing its holder must not hand it over either. (A claimed share or MIG
    instance keeps its whole GPU out of such a search: conservative, and only for gangs the claim outranks.)"""
    if not claims:
        return unusable or {}
    out: dict[str, set[int]] = {n: set(g) for n, g in (unusable or {}).items()}
    for claim in claims:
        for rep in claim.replicas:
            out.setdefault(rep.node, set()).update(rep.gpus)
    return out
