"""Spares kept in the domain, in the scheduler (issue 34, item 2; the pure parts are phalanx.core.spares).

A segmented gang with `spares_per_segment` K (jobs.shape) is placed as segments of S + K replicas (JobRecord.request)
and reserved at once, all or nothing; `take_spares` (from transitions.reserve) keeps the first S of each segment as
the gang and the last K as its spares. A spare is held by allocation rows like the gang's own, with a negative
replica (-1 - slot): the ledger's unique index keeps every other gang off it, quotas charge it to the job's queue,
and no rank is launched there (JobRecord.allocations holds only the gang's replicas, JobRecord.spares the rest).
The placement JSON's "spares" lists each slot's segment and domain: a slot with no row is a missing spare.

`swap_or_teardown` replaces a teardown when a node of the gang is lost or one of its GPUs fails: within the cycle
and its one transaction, the dead node's rows are released, a spare of the same domain is re-labelled as each of
the dead node's replicas, the attempt's remaining rows move to the next attempt (ledger.spare_rows), and the gang
restarts, every rank, from its last committed checkpoint, with the same rank order elsewhere. Its GPUs never leave
the ledger, so no pending gang can take them meanwhile; the gang does not go back through the queue and the swap
does not count as a failure (max_attempts). With no usable spare in the domain, it is the teardown and requeue of
before. `rebook_spares` (at the start of each scheduling pass, before pending gangs are placed) books a missing
spare again on free GPUs of its domain: the node that returned, or another one.
"""

from __future__ import annotations

import copy

import structlog

from phalanx.api.v1 import agent_pb2
from phalanx.core.gang_recovery import choose_swap, recovery_policy
from phalanx.core.model import NodeCapacity
from phalanx.core.placement.segments import default_segment_tier
from phalanx.core.placement.tiers import tier_level
from phalanx.core.resources import room
from phalanx.core.spares import SpareSlot, slot_of, swapped_allocations

from . import ledger
from .elastic import shrink_changes
from .ledger.spare_rows import rewrite_spare_rows
from .pools import pool_swap
from .spare_fields import spare_slots, spares_per_segment
from .state import TERMINAL_RANK_STATES, JobRecord, layout_ranks
from .transitions import Cycle, change_job, master_port, port_range, ports_taken, send_launches, teardown

log = structlog.get_logger()


def unusable_nodes(cycle: Cycle) -> set[str]:
    """Nodes a spare there cannot serve on: not schedulable (lost, drained, FATAL) or with a FATAL GPU."""
    return {n.name for n in cycle.state.nodes.values() if not n.schedulable or n.fatal_gpus}


def swap_or_teardown(cycle: Cycle, job: JobRecord, dead: str, *, cause: str, message: str) -> None:
    """Swap spares of the domain in for the replicas on node `dead`, else tear the gang down (teardown)."""
    if not try_swap(cycle, job, dead, cause=cause, message=message):
        teardown(cycle, job, cause=cause, message=message)


def try_swap(cycle: Cycle, job: JobRecord, dead: str, *, cause: str, message: str) -> bool:
    """Swap spares of the domain in for the replicas on node `dead` (the gang's own, else a spare pool's node there):
    True when it did; False, nothing changed, when the gang has no usable spare there."""
    chosen = None
    if job.spares and job.state == "RUNNING" and not job.preempted_by:
        segment = int(job.shape.get("segment") or 0)
        actives = ((r, n) for r, n, _ in job.allocations)
        domains = job.placement.get("segments") or ()
        # The recovery decision the simulator evaluates (phalanx.core.recovery through gang_recovery): a swap when
        # the domain has a usable spare for each replica of `dead`; otherwise (shrink or requeue) the teardown below
        # decides the shrink (elastic.shrink_changes) with the same rule.
        policy = recovery_policy(spares_per_segment(job), job.min_replicas, len(job.allocations))
        chosen = choose_swap(actives, spare_slots(job), segment, domains, dead, unusable_nodes(cycle), policy)
    if chosen is None:
        # No spare of its own there: a node of an operator's spare pool in that domain (pools.pool_swap), else the
        # caller's teardown and requeue.
        return pool_swap(cycle, job, dead, swap, cause=cause, message=message)
    swap(cycle, job, dead, chosen, cause=cause, message=message)
    return True


def swap(
    cycle: Cycle, job: JobRecord, dead: str, chosen: dict[int, SpareSlot], *, cause: str, message: str, pool: str = ""
) -> None:
    """The swap itself, in this cycle's transaction: the old attempt's ranks killed and its end recorded (as a
    teardown does), the ledger's rows rewritten (released on `dead`, spares re-labelled, the rest moved to the next
    attempt), and the next attempt launched from the last committed checkpoint. `pool`: the chosen "spares" are
    GPUs of that operator's spare pool's node (pools.pool_swap), already taken in the view: no rows to re-label,
    new rows written for the next attempt instead."""
    state, now, old = cycle.state, cycle.now, job.attempt
    where = f"pool {pool}, " if pool else ""
    moves = sorted({f"{dead} -> {s.node} ({where}{s.domain})" for s in chosen.values()})
    source = f"node of spare pool {pool}" if pool else "spare"
    what = f"{message}; {source} {', '.join(moves)} swapped in, restarting from the last committed checkpoint"
    for name in sorted({r.node for r in job.ranks.values() if r.state not in TERMINAL_RANK_STATES}):
        node = state.nodes.get(name)
        if node is not None:
            kill = agent_pb2.KillJob(job_id=job.id, attempt=old, reason=what)
            cycle.send(node, job.id, old, "kill", lambda rev, k=kill: agent_pb2.Assignment(revision=rev, kill=k))
    cycle.work.later(ledger.end_attempt, copy.copy(job), cause, what, now, False)
    # The dead node's part of the gang (its replicas, and a spare there) leaves the view and the ledger; the
    # spares taken keep their GPUs, which only change replica.
    for rep in job.replica_placements():
        if rep.node == dead:
            state.capacity.release_replica(rep)
    state.hold_fatal_gpus([dead])
    relabel = {} if pool else {s.replica: replica for replica, s in chosen.items()}
    lost = [r for r, n, _ in job.spares if n == dead]
    job.allocations = swapped_allocations(job.allocations, chosen)
    job.spares = [row for row in job.spares if row[0] not in relabel and row[1] != dead]
    dead_id = state.nodes[dead].id
    cycle.work.write(rewrite_spare_rows, job.id, old, dead_id, lost, relabel, True, now)
    swaps = dict(job.placement.get("swaps") or {})
    placement = dict(job.placement, swaps=dict(count=int(swaps.get("count", 0)) + 1, at=now, last=f"{moves[0]}"))
    if pool:
        placement["swaps"]["pool"] = int(swaps.get("pool", 0)) + 1  # how many of them came from a pool
    # A new MASTER_PORT on rank 0's host (moved or not): the old attempt's rank 0 may still hold its port there while
    # it exits, and an agent refuses a launch whose port another attempt holds.
    master = chosen[0].node if 0 in chosen else job.allocations[0][1]
    taken = ports_taken(cycle, master)
    avoid = taken | {int(job.placement.get("master_port") or 0)}
    placement["master_port"] = master_port(job.id, old + 1, port_range(state.nodes.get(master)), avoid)
    taken.add(placement["master_port"])
    change_job(cycle, job, attempt=old + 1, started_at=now, placement=placement, message=what)
    job.ranks = layout_ranks(job)
    job.running_at = 0.0
    job.restored_step = cycle.work.read(ledger.latest_commits, [job.id]).get(job.id, (-1,))[0]
    cycle.work.write(ledger.insert_attempts, [copy.copy(job)], now)
    if pool:  # the pool node's rows, written after this cycle's releases (a borrower's), as reservations are
        stub = copy.copy(job)
        stub.allocations = [(r, s.node, s.gpus) for r, s in sorted(chosen.items())]
        stub.spares, stub.partials = [], {}
        cycle.work.new_spares.append(stub)
    send_launches(cycle, job)
    job.launch_deadline = now + cycle.settings.launch_timeout
    cycle.touched(job)
    log.warning("spare_swapped", job=job.id, attempt=job.attempt, dead=dead, moves=moves, cause=cause, pool=pool)


def drop_spares_on(cycle: Cycle, dead: str, gpus: frozenset[int] | None = None) -> None:
    """Node `dead` is lost (or its GPUs `gpus` failed): the spares booked there (on those GPUs) become missing, their
    rows released; rebook_spares books them again when a node of their domain is free."""
    for job in cycle.state.jobs.in_state("RUNNING").values():
        lost = [row for row in job.spares if row[1] == dead and (gpus is None or gpus & set(row[2]))]
        if not lost:
            continue
        for rep in job.replica_placements():
            if (rep.replica, rep.node, tuple(rep.gpus)) in lost:
                cycle.state.capacity.release_replica(rep)
        cycle.state.hold_fatal_gpus([dead])
        job.spares = [row for row in job.spares if row not in lost]
        cycle.work.write(rewrite_spare_rows, job.id, job.attempt, None, [r for r, _, _ in lost], {}, False, cycle.now)
        cycle.touched(job)
        log.warning("spare_lost", job=job.id, node=dead, slots=[slot_of(r) for r, _, _ in lost])


def rebook_spares(cycle: Cycle) -> None:
    """Book every missing spare of a running gang again on free GPUs of its domain (the node that returned, or
    another), before the pass places pending gangs there. Cheap when no gang misses one: a look at each running
    gang's shape."""
    for job in cycle.state.jobs.in_state("RUNNING").values():
        if not job.shape or job.preempted_by or not job.placement.get("spares"):
            continue
        if len(job.spares) >= len(job.placement["spares"]):
            continue
        booked = False
        for slot in spare_slots(job):
            if not slot.booked:
                booked = _book(cycle, job, slot) or booked
        if booked:
            cycle.touched(job)


def _book(cycle: Cycle, job: JobRecord, slot: SpareSlot) -> bool:
    """Book one missing spare on the free node of its domain with the fewest free GPUs that holds it (best fit),
    off the gang's own nodes where it can."""
    capacity, g = cycle.state.capacity, job.gpus_per_replica
    tiers = cycle.settings.fabric.tiers
    tier = str(job.shape.get("segment_tier") or "") or default_segment_tier(tiers)
    level = tier_level(capacity, tier, tiers)
    if level is None:
        return False
    if level == 0:
        members = [capacity.nodes[slot.domain]] if slot.domain in capacity.nodes else []
    elif level < capacity.levels():
        members = capacity.members(level, slot.domain)
    else:
        members = list(capacity.nodes.values())
    own = set(job.nodes)
    # Never on what a waiting preemptor claims (invariant b: a spare has the gang's priority), nor on GPUs in MIG
    # mode or with a foreign MIG instance (a spare holds whole GPUs).
    claimed = {node for claim in cycle.state.claims.values() for node in claim.nodes} if cycle.state.claims else set()
    fits = [
        n
        for n in members
        if n.schedulable
        and n.name not in claimed
        and n.name not in capacity.lending  # a spare pool's node (pools.py) is not a gang's own spare
        and len(_whole(n)) >= g
        and _room(n, job)
        and _model(n, job)
    ]
    if not fits:
        return False
    node = min(fits, key=lambda n: (n.name in own, len(n.free), n.name))
    gpus = tuple(sorted(_whole(node))[:g])
    capacity.take(node.name, gpus)
    if job.cpu_milli or job.memory:
        capacity.take_use(node.name, job.cpu_milli, job.memory)
    row = (slot.replica, node.name, gpus)
    job.spares = sorted([*job.spares, row], reverse=True)
    stub = copy.copy(job)
    stub.allocations, stub.spares, stub.partials = [], [row], {}
    cycle.work.new_spares.append(stub)  # written with the reservations, after this cycle's releases
    log.info("spare_booked", job=job.id, slot=slot.slot, node=node.name, domain=slot.domain)
    return True


def still_booked(cycle: Cycle) -> list[JobRecord]:
    """The spares booked again in this cycle whose gang still runs the same attempt and holds them: a gang torn
    down, preempted or swapped later in the cycle released them with its attempt (in the view; its rows were never
    written), so they must not be written now."""
    out = []
    for stub in cycle.work.new_spares:
        job = cycle.state.jobs.get(stub.id)
        if job is None or job.state != "RUNNING" or job.attempt != stub.attempt:
            continue
        if stub.spares and stub.spares[0] in job.spares:
            out.append(stub)
        elif stub.allocations and stub.allocations[0] in job.allocations:  # a pool node swapped in (pools.py)
            out.append(stub)
    return out


def _whole(node: NodeCapacity) -> set[int]:
    """The node's free GPUs a whole-GPU replica may take."""
    return node.free - set(node.mig_gpus) - set(node.foreign) if node.mig_gpus or node.foreign else node.free


def _room(node: NodeCapacity, job: JobRecord) -> bool:
    left = room(node, job.cpu_milli, job.memory)
    return left is None or left >= 1


def _model(node: NodeCapacity, job: JobRecord) -> bool:
    return not job.gpu_model or job.gpu_model.lower() in node.gpu_model.lower()


def leave_drained_node(cycle: Cycle, name: str, message: str) -> None:
    """Node `name` is draining (its agent got SIGTERM and kills its ranks): a gang with a spare for its replicas
    there swaps it in now, as for a lost node, and an elastic gang that keeps its minimum elsewhere shrinks now
    (NODE_DRAINED), rather than both being requeued as failures when the killed ranks report in. Spares booked there
    become missing. Any other gang is left to the ranks' reports (a requeue, as before)."""
    for job in list(cycle.state.jobs.in_state("RUNNING").values()):
        if job.preempted_by or all(node != name for _, node, _ in job.allocations):
            continue
        if try_swap(cycle, job, name, cause="NODE_DRAINED", message=message):
            continue
        if shrink_changes(cycle.state, job, "NODE_DRAINED", message) is not None:
            teardown(cycle, job, cause="NODE_DRAINED", message=message)
    drop_spares_on(cycle, name)
