"""The scheduler-facing side of the recovery decision (issue 34): a running gang as the scheduler holds it (its
replicas' nodes, its spare slots, its segments' domains, its elastic minimum) -> `phalanx.core.recovery`'s
`GangAtFailure` and policy, and a decision back into the scheduler's terms. Pure: no I/O.

The scheduler's swap (services/scheduler/spares.py) and shrink (services/scheduler/elastic.py) both go through
`decide_recovery`, the rule the simulator evaluates, so the scheduler does what the evaluation measures by
construction:

- `recovery_policy`: a gang with spares -> swap first (`spares`); an elastic gang -> shrink (`elastic`); both ->
  `spares+elastic`; neither -> `requeue`.
- `choose_swap`: which spare slot takes each replica of a dead node (None: the decision was not a swap). The
  gang's spares are given per domain, one entry per slot (`GangAtFailure.per_rank`): a spare is one replica's worth
  of GPUs, and a node of k replicas needs k spares of its domain. The dead node's own segment's slots come first
  (then another segment's of the same domain), the slots in order.
- `elastic_gang`: the gang as the shrink decision sees it, one entry per replica, so that a replica on a healthy GPU
  of a node with a fatal one still counts as surviving.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from .recovery import SWAP, GangAtFailure, decide_recovery
from .spares import SpareSlot


def recovery_policy(spares_per_segment: int, min_replicas: int, replicas: int) -> str:
    """The recovery policy of a gang: from its spares per segment and its elastic range (MIN, MAX)."""
    spares = spares_per_segment > 0
    elastic = 0 < min_replicas < replicas
    if spares and elastic:
        return "spares+elastic"
    return "spares" if spares else "elastic" if elastic else "requeue"


def _domain_key(segment: int, segment_domains: Sequence[str]) -> str:
    """A segment's domain, or a name of its own when it has none (its spares then serve it alone)."""
    domain = segment_domains[segment] if 0 <= segment < len(segment_domains) else ""
    return domain or f"segment {segment}"


def swap_gang(
    job: str,
    actives: Iterable[tuple[int, str]],
    spares: Sequence[SpareSlot],
    segment: int,
    segment_domains: Sequence[str],
    dead: str,
    unusable: Iterable[str] = (),
    min_replicas: int = 0,
) -> tuple[GangAtFailure, list[SpareSlot]]:
    """The gang for `decide_recovery` (ranks: the node of each replica; each node's domain: its segment's; spares:
    the booked slots on usable nodes, one entry each, the dead node's segment's first) and those slots, listed in
    the order the decision takes them."""
    ordered = sorted(actives)
    ranks = tuple(node for _, node in ordered)
    keys: dict[int, str] = {}  # each segment's domain key, worked out once
    domain_of: dict[str, str] = {}
    hit_segments: set[int] = set()
    for replica, node in ordered:
        seg = replica // segment if segment > 0 else -1
        key = keys.get(seg)
        if key is None:
            key = keys[seg] = _domain_key(seg, segment_domains)
        domain_of[node] = key  # a node lies in one domain of the tier: every replica on it gives the same
        if node == dead:
            hit_segments.add(seg)
    bad = {dead, *unusable}
    usable = [s for s in spares if s.booked and s.node not in bad]
    usable.sort(key=lambda s: (s.segment not in hit_segments, s.slot))
    per_domain: dict[str, list[str]] = {}
    for s in usable:
        per_domain.setdefault(_domain_key(s.segment, segment_domains), []).append(s.node)
    low = min(max(min_replicas, 0), len(ranks)) or len(ranks)
    gang = GangAtFailure(job, ranks, domain_of, min_replicas=low, spares=per_domain, per_rank=True)
    return gang, usable


def choose_swap(
    actives: Iterable[tuple[int, str]],
    spares: Sequence[SpareSlot],
    segment: int,
    segment_domains: Sequence[str],
    dead: str,
    unusable: Iterable[str] = (),
    policy: str = "spares",
) -> dict[int, SpareSlot] | None:
    """Which booked spare takes each active replica of node `dead`: {replica: spare}, as `decide_recovery` decides
    under `policy`. A replica's spare lies in its segment's domain, on a node that is neither `dead` nor
    `unusable`. None when the decision is not a swap (too few spares there, or the gang has no replica on `dead`)."""
    actives = sorted(actives)
    if segment <= 0 or not any(n == dead for _, n in actives):
        return None
    gang, slots = swap_gang("gang", actives, spares, segment, segment_domains, dead, unusable)
    decision = decide_recovery(gang, {dead}, policy)
    if decision.action != SWAP:
        return None
    return slots_of_swap(actives, decision.ranks, slots, dead)


def slots_of_swap(
    actives: Sequence[tuple[int, str]], ranks_after: Sequence[str], slots: Sequence[SpareSlot], dead: str
) -> dict[int, SpareSlot]:
    """A swap decision's new node of each replica of `dead` -> the spare slot it takes there (the first one of that
    node not taken yet, in the order the decision took them)."""
    left = list(slots)
    chosen: dict[int, SpareSlot] = {}
    for (replica, node), new in zip(actives, ranks_after, strict=True):
        if node != dead:
            continue
        pick = next(s for s in left if s.node == new)
        left.remove(pick)
        chosen[replica] = pick
    return chosen


def elastic_gang(
    job: str, replicas: Sequence[int], min_replicas: int, lost: Collection[int], multiple: int = 1
) -> tuple[GangAtFailure, set[str]]:
    """An elastic gang for the shrink decision: one entry per replica (`replicas`, its current attempt's active
    ones), and the entries of the `lost` ones (on a lost node or a fatal GPU; a spare's negative index is no rank and
    is left out). `multiple`: a segmented gang shrinks by whole segments (its segment size)."""
    keys = tuple(f"replica {r}" for r in sorted(replicas))
    gang = GangAtFailure(
        job, keys, dict.fromkeys(keys, ""), min_replicas=min(min_replicas, len(keys)), multiple=max(1, multiple)
    )
    return gang, {f"replica {r}" for r in lost if r >= 0}
