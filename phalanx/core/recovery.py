"""What to do with a running gang when nodes under it fail: swap in spares, shrink, or requeue. Pure: no I/O.

One decision, shared by the simulator (`phalanx.sim.recovery_replay`, which compares the four policies on a trace
with failures) and the scheduler's spares and elastic paths (issue 34; its adapter is `phalanx.core.gang_recovery`),
so that what the evaluation measures is what the scheduler does.

The actions, cheapest first:

- **swap**: every failed node is replaced by a node of the *same domain* (the segment's NVLink domain, or the leaf
  switch): a spare the gang holds there, or (the spare being missing) a free node of that domain, booked as the
  spare would have been. The gang restarts from its last checkpoint, warm, on the same domains, at the same world
  size, and every rank not on a failed node keeps its node.
- **shrink** (elastic gangs, `min_replicas` < `replicas`): the gang drops the ranks on the failed nodes and restarts
  from its last checkpoint at the smaller world size (rounded down to a multiple of `multiple`, e.g. the segment size
  or TP x PP), on the surviving nodes, warm, when that size is at least `min_replicas`.
- **requeue**: the whole gang is torn down and waits in the queue for a fresh placement (a cold start).

The policies (`POLICIES`): `requeue` (always requeue), `spares` (swap, else requeue), `elastic` (shrink, else
requeue), `spares+elastic` (swap, else shrink, else requeue). A swap covers every failed node of the gang or none
(a gang half swapped and half shrunk would restart twice as often as either); likewise a shrink.

The restart cost (`restart_cost`): the work since the last checkpoint is lost whatever the action (the checkpoint
interval is a setting); a swap or shrink then costs a warm restart (`RestartCosts.warm_restart_s`: the processes
start on nodes that hold the image and the dataset cache, and load the checkpoint over the domain's fabric), a
requeue a cold start (`cold_start_s`) after whatever time it waits in the queue, which is the scheduler's (or the
simulator's) to measure, not this module's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

POLICIES = ("requeue", "spares", "elastic", "spares+elastic")
SWAP, SHRINK, REQUEUE, NOTHING = "swap", "shrink", "requeue", "none"


@dataclass(frozen=True)
class GangAtFailure:
    """A running gang as the recovery decision sees it.

    `ranks`: the node of each replica, in rank order (several replicas may share a node). `domain_of`: the domain of
    each of its nodes (and of its spares). `spares`: the idle spare nodes it holds, per domain. `min_replicas`: the
    smallest world size it may shrink to (= `replicas` for a gang that is not elastic). `multiple`: a shrunk world
    size must be a multiple of it (1: any size). `per_rank`: each entry of `spares` is one replica's worth (a node may
    be listed once per spare slot it holds, the scheduler's spares), so a failed node hosting k ranks needs k of
    them; False (the simulator's whole-node spares): one spare node replaces a failed node and all its ranks."""

    job: str
    ranks: tuple[str, ...]
    domain_of: Mapping[str, str]
    min_replicas: int = 0
    spares: Mapping[str, Sequence[str]] = field(default_factory=dict)
    multiple: int = 1
    per_rank: bool = False

    @property
    def replicas(self) -> int:
        return len(self.ranks)

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"gang {self.job}: no ranks")
        missing = sorted({n for n in self.ranks if n not in self.domain_of})
        if missing:
            raise ValueError(f"gang {self.job}: no domain for node(s) {', '.join(missing)}")
        if self.min_replicas < 0 or self.min_replicas > self.replicas:
            raise ValueError(
                f"gang {self.job}: min_replicas must be 0..{self.replicas} (its size), got {self.min_replicas}"
            )
        if self.multiple < 1:
            raise ValueError(f"gang {self.job}: multiple must be >= 1, got {self.multiple}")


@dataclass(frozen=True)
class Recovery:
    """The decision. `action`: swap, shrink or requeue (or none, when no node of the gang failed). `swaps`: (failed
    node, its replacement, True when the replacement was a free node rather than a held spare), for a swap. `ranks`:
    the node of each rank after the action (empty for a requeue). `release`: the gang's nodes it no longer holds
    (the failed ones, and for a shrink any survivor left without a rank; every node for a requeue). `reason`: why,
    for a person."""

    action: str
    ranks: tuple[str, ...] = ()
    swaps: tuple[tuple[str, str, bool], ...] = ()
    release: tuple[str, ...] = ()
    reason: str = ""

    @property
    def replicas(self) -> int:
        return len(self.ranks)


def decide_recovery(
    gang: GangAtFailure,
    failed: Collection[str],
    policy: str,
    free: Mapping[str, Sequence[str]] | None = None,
) -> Recovery:
    """The recovery of `gang` after `failed` nodes died under `policy`; `free`: the free (schedulable, idle) nodes
    per domain that a swap may book when the gang's own spare there is missing."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recovery policy {policy!r}; policies: {', '.join(POLICIES)}")
    failed = set(failed)
    hit = [n for n in dict.fromkeys(gang.ranks) if n in failed]
    if not hit:
        return Recovery(NOTHING, gang.ranks, reason="no node of the gang failed: nothing to do")
    reasons = []
    if policy in ("spares", "spares+elastic"):
        swapped = _swap(gang, hit, set(failed), free or {})
        if isinstance(swapped, Recovery):
            return swapped
        reasons.append(swapped)
    if policy in ("elastic", "spares+elastic"):
        shrunk = _shrink(gang, hit)
        if isinstance(shrunk, Recovery):
            return shrunk
        reasons.append(shrunk)
    why = "; ".join(reasons) or f"policy {policy} requeues"
    return Recovery(REQUEUE, release=tuple(dict.fromkeys(gang.ranks)), reason=why)


def _swap(gang: GangAtFailure, hit: list[str], failed: set[str], free: Mapping[str, Sequence[str]]) -> Recovery | str:
    """Each failed node replaced by a spare of its domain (else a free node there), or why not. With `per_rank`,
    each rank of a failed node takes its own spare entry of the domain (in the order listed), and `swaps` has one
    (failed node, replacement, from free) per moved rank (a failed node's ranks in rank order)."""
    left = {d: [s for s in nodes if s not in failed] for d, nodes in gang.spares.items()}  # entries still to take
    taken: set[str] = set()
    gang_nodes = set(gang.ranks)
    swaps: list[tuple[str, str, bool]] = []
    for node in hit:
        domain = gang.domain_of[node]
        for _ in range(gang.ranks.count(node) if gang.per_rank else 1):
            pool = left.get(domain, [])
            spare = next((s for s in pool if gang.per_rank or s not in taken), None)
            from_free = spare is None
            if spare is not None:
                pool.remove(spare)
            else:
                spare = next(
                    (s for s in free.get(domain, ()) if s not in failed and s not in taken and s not in gang_nodes),
                    None,
                )
            if spare is None:
                return f"no spare or free node left in domain {domain} for {node}"
            taken.add(spare)
            swaps.append((node, spare, from_free))
    if gang.per_rank:
        queues: dict[str, list[str]] = {}
        for old, new, _ in swaps:
            queues.setdefault(old, []).append(new)
        ranks = tuple(queues[n].pop(0) if n in queues else n for n in gang.ranks)
    else:
        moved = {old: new for old, new, _ in swaps}
        ranks = tuple(moved.get(n, n) for n in gang.ranks)
    held = sum(1 for *_, f in swaps if not f)
    return Recovery(
        SWAP,
        ranks,
        tuple(swaps),
        tuple(hit),
        f"{len(swaps)} node(s) replaced in their domains ({held} held spare(s), {len(swaps) - held} free node(s))",
    )


def _shrink(gang: GangAtFailure, hit: list[str]) -> Recovery | str:
    """The ranks on surviving nodes, cut to a multiple of `gang.multiple`, if that is at least MIN; or why not."""
    lost = set(hit)
    survivors = [n for n in gang.ranks if n not in lost]
    size = len(survivors) // gang.multiple * gang.multiple
    floor = max(gang.min_replicas, 1)
    if gang.min_replicas >= gang.replicas:
        return "not elastic (min_replicas = replicas)"
    if size < floor:
        return f"{len(survivors)} surviving rank(s) give a world size of {size}, under its minimum {floor}"
    ranks = tuple(survivors[:size])
    kept = set(ranks)
    release = tuple(n for n in dict.fromkeys(gang.ranks) if n not in kept)
    return Recovery(SHRINK, ranks, release=release, reason=f"shrunk from {gang.replicas} to {size} ranks")


@dataclass(frozen=True)
class RestartCosts:
    """The restart-cost model (seconds). Defaults are stated assumptions, not measurements: a 30-minute checkpoint
    interval (Llama 3-era pre-training checkpoints every few tens of minutes), a 5-minute warm restart on nodes that
    hold the image and data cache, a 15-minute cold start (image pull, dataset cache, NCCL set-up at full scale)."""

    checkpoint_interval_s: float = 1800.0
    warm_restart_s: float = 300.0
    cold_start_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("checkpoint_interval_s", "warm_restart_s", "cold_start_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.checkpoint_interval_s == 0:
            raise ValueError("checkpoint_interval_s must be > 0")


@dataclass(frozen=True)
class RestartCost:
    """What a recovery costs the gang: `lost_work_s` (work since its last checkpoint, done again) and `restart_s`
    (time until it computes again; for a requeue, after its wait in the queue)."""

    lost_work_s: float
    restart_s: float

    @property
    def total_s(self) -> float:
        return self.lost_work_s + self.restart_s


def checkpointed(work_s: float, costs: RestartCosts) -> float:
    """The part of `work_s` seconds of work that the last periodic checkpoint saved."""
    return math.floor(max(0.0, work_s) / costs.checkpoint_interval_s) * costs.checkpoint_interval_s


def restart_cost(action: str, work_s: float, costs: RestartCosts) -> RestartCost:
    """The cost of `action` for a gang that did `work_s` seconds of work since its (re)start, checkpointing every
    `costs.checkpoint_interval_s`."""
    if action not in (SWAP, SHRINK, REQUEUE):
        raise ValueError(f"unknown recovery action {action!r}")
    lost = max(0.0, work_s) - checkpointed(work_s, costs)
    return RestartCost(lost, costs.cold_start_s if action == REQUEUE else costs.warm_restart_s)
