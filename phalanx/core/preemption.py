"""The preemption decision: which running gangs to evict so a higher-priority gang can be placed. Pure: no I/O.

The rules (also in docs/design.md, "Preemption rules"):

- Priorities are integers, higher wins; named classes map to integers (`PRIORITY_CLASSES`, `parse_priority`).
- Only gangs of strictly lower priority are candidates: equal priorities never preempt each other.
- A gang is protected for `PreemptionPolicy.min_runtime_s` after it starts (no thrash, no cascades).
- Victims are whole gangs, taken in the order: lowest priority first, then least work lost since their last committed
  checkpoint, then job id. The shortest prefix of that order whose release makes `place_gang` succeed (honouring
  the pending gang's `required_tier`) is taken, then pruned: victims are tried, costliest first, and left running
  whenever the gang still fits without them. What is left is minimal: no single victim can be spared.
- Locality: every victim holds GPUs on at least one node of the preemptor's resulting placement. So no gang is
  evicted from a leaf (or any other domain) the preemptor will not use. (A victim that spans several nodes is still
  evicted whole, including its GPUs elsewhere: gangs are all or nothing.)
- The caller's capacity is never changed: the search runs on a copy.

Cost: one copy of the capacity view, O(log k) placements and O(k) releases to find the prefix of k victims (a
galloping search: prefixes of 1, 2, 4 ... then a binary search), and at most one placement per prefix victim that
shares a node with the current placement while pruning (a victim on no node of it is spared
without placing again: the current placement does not need its GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from .capacity import ClusterCapacity
from .elastic_units import split_at_minimum
from .model import GangRequest, Placement, ReplicaPlacement
from .placement import Unplaceable, place_gang
from .status import Code, Status

# Named priority classes. Integers in between are allowed too (`--priority 50`).
PRIORITY_CLASSES: dict[str, int] = {
    "best-effort": -200,
    "batch": -100,
    "default": 0,
    "high": 100,
    "critical": 200,
}


def parse_priority(value: str | int) -> int:
    """An integer priority from an integer, a decimal string ("-5", "+10") or a class name ("high", any case)."""
    if isinstance(value, bool):
        raise ValueError(f"priority must be an integer or a class name, got {value!r}")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError(f"priority must be an integer or a class name, got {value!r}")
    text = value.strip()
    try:
        return int(text, 10)
    except ValueError:
        pass
    named = PRIORITY_CLASSES.get(text.lower())
    if named is None:
        known = ", ".join(f"{name} ({p})" for name, p in PRIORITY_CLASSES.items())
        raise ValueError(f"unknown priority {value!r}: give an integer or one of {known}")
    return named


def priority_name(priority: int) -> str:
    """100 -> '100 (high)'; a number of no class stays a number."""
    named = next((name for name, p in PRIORITY_CLASSES.items() if p == priority), "")
    return f"{priority} ({named})" if named else str(priority)


@dataclass(frozen=True, slots=True)
class PreemptionPolicy:
    """Settings of preemption. `min_runtime_s`: a gang cannot be preempted for this long after it starts.
    `grace_period_s`: how long a victim has, after being asked to checkpoint, before it is stopped (used by the
    scheduler, not by `choose_victims`)."""

    min_runtime_s: float = 600.0
    grace_period_s: float = 120.0

    def __post_init__(self) -> None:
        if self.min_runtime_s < 0 or self.grace_period_s < 0:
            raise ValueError("min_runtime_s and grace_period_s must be >= 0")


# Production defaults: ten minutes of protection (a gang gets past its start-up and a first checkpoint before it can
# be evicted), two minutes to write a checkpoint once asked.
PRODUCTION_POLICY = PreemptionPolicy(min_runtime_s=600.0, grace_period_s=120.0)
# The local cluster's defaults: short, so preemption shows within a demo.
LOCAL_POLICY = PreemptionPolicy(min_runtime_s=5.0, grace_period_s=3.0)


@dataclass(frozen=True, slots=True)
class RunningGang:
    """A running gang as preemption sees it. `work_since_checkpoint`: what evicting it now would lose (seconds or
    GPU-seconds of progress since its last committed checkpoint, computed by the caller; only compared between gangs
    of equal priority, so any consistent non-negative unit works)."""

    job_id: str
    priority: int
    placement: Placement
    started_at: float
    work_since_checkpoint: float = 0.0
    # Not a gang to evict but GPUs an ended gang is still releasing (its processes exiting; `job_id` is the ended
    # gang's, and may repeat): waiting for them costs nothing, they come free by themselves. Among candidates of
    # equal cost they come first, in the caller's order; a preemption lists them in `waits_for`, not in `victims`.
    releasing: bool = False
    # An elastic gang above its minimum comes as two parts of one job (`elastic_parts`): SHRINK, the replicas beyond
    # its minimum, and CORE, its minimum's; taking only the first shrinks it (it restarts at its minimum, on what it
    # kept) rather than evicting it whole. WHOLE: any other gang.
    part: int = 0


WHOLE, SHRINK, CORE = 0, 1, 2


def elastic_parts(gang: RunningGang, request: GangRequest) -> list[RunningGang]:
    """A running elastic gang as preemption candidates: the replicas beyond `request.min_replicas` (taken first; a
    segmented gang's whole segments beyond its minimum, with their spares: elastic_units) and the rest; the gang itself
    when it runs at its minimum. Both parts carry the gang's work since its checkpoint: a shrink is a restart too."""
    core, extra = split_at_minimum(request, gang.placement.replicas)
    if not core or not extra:
        return [gang]
    p = gang.placement

    def part(kind: int, replicas: tuple[ReplicaPlacement, ...]) -> RunningGang:
        placement = Placement(p.job_id, replicas, p.tier, p.domains, p.score, p.reason)
        return RunningGang(
            gang.job_id, gang.priority, placement, gang.started_at, gang.work_since_checkpoint, part=kind
        )

    return [part(SHRINK, extra), part(CORE, core)]


@dataclass(frozen=True, slots=True)
class Preemption:
    """Evict `victims` (job ids, in eviction order: cheapest first) and `placement` is where the preemptor goes; it
    is valid once exactly the victims' GPUs (and those of `waits_for`, the releasing candidates it counts on) are
    released. `work_lost`: the victims' work since checkpoint, summed."""

    job_id: str
    victims: tuple[str, ...]
    placement: Placement
    work_lost: float
    reason: str
    waits_for: tuple[RunningGang, ...] = ()
    # Victims that are elastic gangs stopped only to shrink: they restart at their minimum on what they keep.
    shrunk: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NoPreemption:
    """No admissible set of victims. `retry_in`: seconds until gangs now protected by their minimum runtime would
    make it fit (None when waiting for protection to end would not help)."""

    job_id: str
    reason: str
    retry_in: float | None = None

    @property
    def status(self) -> Status:
        """PROTECTED when gangs' minimum runtime is what keeps the preemptor out, else UNSCHEDULABLE."""
        return Status(Code.PROTECTED if self.retry_in is not None else Code.UNSCHEDULABLE, self.reason)


def _cost(gang: RunningGang) -> tuple[int, float, bool, str, int]:
    """Eviction order: lowest priority, least work lost, then job id (an elastic gang's replicas beyond its minimum
    before the rest); releasing GPUs first among equals, in the caller's order (the sort is stable)."""
    return (
        gang.priority,
        gang.work_since_checkpoint,
        not gang.releasing,
        "" if gang.releasing else gang.job_id,
        gang.part,
    )


class _Work:
    """The copy, with some running gangs released. Releases and restores mirror each other without the checks of
    `reserve` (the gangs' placements come from the caller's view, where they are held)."""

    def __init__(self, capacity: ClusterCapacity, unusable: Mapping[str, Collection[int]]) -> None:
        self.cap = capacity.copy()
        self.unusable = unusable

    def release(self, gang: RunningGang) -> None:
        self.cap.release_placement(gang.placement)
        for node in gang.placement.nodes:
            held = self.unusable.get(node)
            if held:
                self.cap.take(node, held)

    def restore(self, gang: RunningGang) -> None:
        for rep in gang.placement.replicas:
            if rep.mig_profile or rep.gpu_milli:
                self.cap.take_partial(rep)
            else:
                self.cap.take(rep.node, rep.gpus)
            if rep.cpu_milli or rep.memory:
                self.cap.take_use(rep.node, rep.cpu_milli, rep.memory)


def _shortest_prefix(
    work: _Work,
    gangs: list[RunningGang],
    pending: GangRequest,
    fabric_tiers: Sequence[str],
    fits: Placement,
    lo: int = 0,
    hi: int | None = None,
) -> tuple[int, Placement]:
    """With gangs[:hi] released in `work` (default: all of them) and the gang fitting then, at `fits`, but not with
    gangs[:lo] released: the least k such that releasing gangs[:k] makes it fit, and a placement then. Leaves
    exactly gangs[:k] released. Feasibility only grows with the prefix, so a binary search: O(log(hi - lo))
    placements and O(hi - lo) releases and restores in all."""
    hi = len(gangs) if hi is None else hi
    witness = fits  # prefix lo does not fit, prefix hi does
    released = hi

    def move(to: int) -> None:
        nonlocal released
        while released > to:
            released -= 1
            work.restore(gangs[released])
        while released < to:
            work.release(gangs[released])
            released += 1

    while hi - lo > 1:
        mid = (lo + hi) // 2
        move(mid)
        got = place_gang(work.cap, pending, fabric_tiers)
        if isinstance(got, Placement):
            hi, witness = mid, got
        else:
            lo = mid
    move(hi)
    return hi, witness


def _gallop(
    work: _Work, gangs: list[RunningGang], pending: GangRequest, fabric_tiers: Sequence[str]
) -> tuple[int, int, Placement | Unplaceable]:
    """Release gangs in order, in prefixes of 1, 2, 4, 8 ... until the gang fits (or all are released). Returns
    (lo, hi, result): gangs[:hi] are released, prefix lo did not fit, and result is the placement with gangs[:hi]
    released, or why it does not fit with all of them. The work is proportional to the prefix needed, not to the
    number of candidates: a large cluster's few cheap victims cost a few releases, not hundreds."""
    lo, size = 0, 1
    released = 0
    while True:
        target = min(size, len(gangs))
        while released < target:
            work.release(gangs[released])
            released += 1
        got = place_gang(work.cap, pending, fabric_tiers)
        if isinstance(got, Placement) or target == len(gangs):
            return lo, target, got
        lo, size = target, size * 2


def _nodes(gang: RunningGang) -> frozenset[str]:
    return frozenset(gang.placement.nodes)


def choose_victims(
    capacity: ClusterCapacity,
    pending: GangRequest,
    running: Sequence[RunningGang],
    now: float,
    policy: PreemptionPolicy = PRODUCTION_POLICY,
    fabric_tiers: Sequence[str] = (),
    unusable: Mapping[str, Collection[int]] | None = None,
) -> Preemption | NoPreemption:
    """The gangs to evict so `pending` can be placed, and where it would go; or why there are none.

    `capacity`: the current free view (the running gangs' GPUs held), never changed. `unusable`: GPUs per node that
    must stay out of the free view even when a victim releases them (the scheduler's FATAL GPUs).
    """
    seen: set[str] = set()
    for gang in running:
        if gang.releasing:
            continue
        key = f"{gang.job_id}/{gang.part}"
        if key in seen:
            raise ValueError(f"running gang {gang.job_id!r} is given twice")
        seen.add(key)
    fits = place_gang(capacity, pending, fabric_tiers)
    if isinstance(fits, Placement):
        return NoPreemption(pending.job_id, "it fits without preemption")
    lower = [g for g in running if g.priority < pending.priority and g.placement.replicas]
    if not lower:
        if any(g.priority == pending.priority for g in running):
            reason = (
                f"only gangs of equal or higher priority (>= {pending.priority}) hold GPUs; equal priorities "
                "never preempt each other"
            )
        elif running:
            reason = f"only gangs of higher priority (> {pending.priority}) hold GPUs"
        else:
            reason = "no running gang to preempt"
        return NoPreemption(pending.job_id, f"{reason}; {fits.reason}")

    def left(gang: RunningGang) -> float:
        return policy.min_runtime_s - (now - gang.started_at)

    candidates = sorted((g for g in lower if left(g) <= 0), key=_cost)
    protected = sorted((g for g in lower if left(g) > 0), key=left)
    work = _Work(capacity, unusable or {})
    lo, hi, whole = _gallop(work, candidates, pending, fabric_tiers)
    if not isinstance(whole, Placement):
        return _refusal(pending, fits, whole, candidates, protected, work, left, fabric_tiers)

    # The shortest prefix of `candidates` that makes the gang fit: the greedy "add victims in order until it fits".
    hi, witness = _shortest_prefix(work, candidates, pending, fabric_tiers, whole, lo, hi)

    # Prune, costliest first: spare every victim without which the gang still fits. `witness` is always a valid
    # placement with the current victims released; a victim on none of its nodes is spared without placing again.
    victims = candidates[:hi]
    kept: list[RunningGang] = []
    for gang in reversed(victims):
        work.restore(gang)
        if _nodes(gang).isdisjoint(witness.nodes):
            continue
        got = place_gang(work.cap, pending, fabric_tiers)
        if isinstance(got, Placement):
            witness = got
        else:
            work.release(gang)
            kept.append(gang)
    kept.reverse()

    # The placement the preemptor gets, and locality: no victim lies entirely off its nodes (never the case for a
    # minimal set when placement is complete; kept as a guard). Each round spares at least one victim.
    while True:
        got = place_gang(work.cap, pending, fabric_tiers)
        placement = got if isinstance(got, Placement) else witness
        used = set(placement.nodes)
        away = [g for g in kept if _nodes(g).isdisjoint(used)]
        if not away:
            break
        for gang in away:
            work.restore(gang)
        kept = [g for g in kept if not _nodes(g).isdisjoint(used)]
        witness = placement
    evicted = [g for g in kept if not g.releasing]
    full = {g.job_id for g in evicted if g.part != SHRINK}
    shrunk = {g.job_id for g in evicted if g.part == SHRINK} - full  # elastic gangs left to restart at MIN
    chosen = tuple(dict.fromkeys(g.job_id for g in evicted))
    lost = sum({g.job_id: g.work_since_checkpoint for g in evicted}.values())  # (an elastic gang's parts: once)
    waits_for = tuple(g for g in kept if g.releasing)
    names = ", ".join(
        f"{g.job_id} (priority {g.priority}{', shrunk to its minimum' if g.job_id in shrunk else ''})"
        for g in {g.job_id: g for g in evicted}.values()
    )
    also = f"; waits for the GPUs of {len(waits_for)} ended gang(s) being released" if waits_for else ""
    reason = (
        f"preempts {len(chosen)} gang(s) of lower priority than {pending.priority}: {names}; work lost since "
        f"their checkpoints {lost:g}{also}; then {placement.reason}"
    )
    return Preemption(pending.job_id, chosen, placement, lost, reason, waits_for, tuple(sorted(shrunk)))


def _refusal(
    pending: GangRequest,
    now_reason: Unplaceable,
    whole: Unplaceable,
    candidates: list[RunningGang],
    protected: list[RunningGang],
    work: _Work,
    left: Callable[[RunningGang], float],
    fabric_tiers: Sequence[str],
) -> NoPreemption:
    """Why no set of admissible victims makes the gang fit, and whether waiting for protected gangs would help."""
    if protected:
        for gang in protected:
            work.release(gang)
        got = place_gang(work.cap, pending, fabric_tiers)
        if not isinstance(got, Placement):
            whole = got  # the reason with every lower-priority gang released
        else:
            # The earliest moment enough protected gangs become candidates: they are ordered by protection left.
            k, _ = _shortest_prefix(work, protected, pending, fabric_tiers, got)
            wait = max(0.0, left(protected[k - 1]))
            if candidates:
                what = (
                    f"evicting the {len(candidates)} unprotected lower-priority gang(s) would not make it fit; "
                    f"{len(protected)} more are"
                )
            else:
                what = f"the {len(protected)} lower-priority gang(s) are"
            return NoPreemption(
                pending.job_id,
                f"{what} protected for their minimum runtime ({math.ceil(wait)} s left before enough of them can be "
                f"preempted); {now_reason.reason}",
                retry_in=wait,
            )
    count = len(candidates) + len(protected)
    return NoPreemption(
        pending.job_id,
        f"even evicting every lower-priority gang ({count}) would not make it fit: {whole.reason}",
    )
