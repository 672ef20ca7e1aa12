"""Invariant (i) of phalanx.core.invariants, spares kept in the domain, as a pure check of one `Started` event:

- a spare lies in its segment's domain (the domain of the segment tier its segment's ranks are in);
- no rank on a spare: the spares' GPUs are the attempt's, and the attempt's other GPUs are exactly its ranks'
  (replicas x GPUs per replica), so no GPU is both;
- (the spare pools, `pool_violations`) no booked node of an operator's spare pool is held by a job without a time
  limit: only backfill jobs with time limits borrow them (a gang that swaps one in takes it out of the pool);
- a swap never lets another gang take the slot: the attempt that replaces a swapped one starts at the very next
  event after that one ended (nothing started, nor was decided, in between), on GPUs that attempt held and no
  other, and what it gave up lies on nodes that are down (the dead node).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from .events import Hold, Started
from .placement.segments import default_segment_tier
from .pools import SparePool


def spare_violations(
    e: Started,
    shape: tuple[int, int, int, str, int],
    domains: Mapping[str, Mapping[str, str]],
    tiers: Sequence[str],
    down: Collection[str],
    ended: tuple[int, int, tuple[Hold, ...]],
    index: int,
) -> list[str]:
    """What `e` breaks of (i). `shape`: the gang's (replicas, GPUs per replica, segment, segment tier, spares per
    segment); `ended`: its last ended attempt as (event index, attempt, holds); `index`: this event's index."""
    replicas, g, segment, segment_tier, per_segment = shape
    out: list[str] = []
    who = f"job {e.job} attempt {e.attempt}"
    held = {(h.node, h.gpu) for h in e.holds}
    spare = {(h.node, h.gpu) for h in e.spare_holds}
    if not spare <= held:
        out.append(f"{who}: spare GPUs {sorted(spare - held)} are not the attempt's")
    if len(held - spare) != replicas * g:
        out.append(f"{who}: {len(held - spare)} GPUs for its ranks, not {replicas} x {g} (a rank on a spare?)")
    if segment > 0 and len(e.spares) > replicas // segment * per_segment:
        out.append(f"{who}: {len(e.spares)} spares, more than {per_segment} per segment")
    where = domains.get(segment_tier or default_segment_tier(tiers))
    if where is not None and segment > 0 and len(e.replica_nodes) == replicas:
        for seg, node in e.spares:
            want = where.get(e.replica_nodes[seg * segment], "") if seg * segment < replicas else ""
            if not want or where.get(node, "") != want:
                out.append(f"{who}: the spare of segment {seg} on {node} lies outside its domain {want or '?'}")
    if e.swap_of:
        at, attempt, before = ended
        if attempt != e.swap_of or at != index - 1:
            out.append(f"{who}: a swap of attempt {e.swap_of} not right after it ended (another gang could move in)")
        old = {(h.node, h.gpu) for h in before}
        if not held <= old:
            out.append(f"{who}: a swap took GPUs {sorted(held - old)[:4]} its attempt did not hold")
        left = {node for node, _ in old - held} - set(down)
        if left:
            out.append(f"{who}: a swap gave up GPUs of live node(s) {sorted(left)}")
    return out


def pool_violations(pools: Iterable[SparePool], jobs: Iterable[tuple[str, float, Collection[str]]]) -> list[str]:
    """The pool invariant: no booked pool node is held by a job without a time limit (a gang that swapped a pool
    node in holds it, but that node has left the pool by then). `jobs`: (id, time limit, nodes) of running jobs."""
    booked = {n: p.name for p in pools for n in p.nodes()}
    out = []
    for job_id, limit, nodes in jobs:
        if limit > 0:
            continue
        for n in sorted(set(nodes) & set(booked)):
            out.append(f"job {job_id} without a time limit holds node {n} of pool {booked[n]}")
    return out
