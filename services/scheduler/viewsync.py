"""Bringing the in-memory view up to date with the ledger, in a cycle's transaction: the whole of it (a start, a
new leader, a stale view), or only the rows other replicas' cycles changed (ledger_changes).

These read the ledger into the view before the cycle's commands and plan run; the job life cycle itself changes
the view and hands its writes to the unit of work (work.py).
"""

from __future__ import annotations

from sqlalchemy import Connection

from . import ledger
from .settings import SchedulerSettings
from .state import NodeRecord, SchedulerState


def reload_state(
    conn: Connection, state: SchedulerState, settings: SchedulerSettings, now: float, *, initial: bool
) -> None:
    """Load the ledger into the view. Leases and launch deadlines are re-armed on the initial load."""
    beats = {n.name: n.last_heartbeat for n in state.nodes.values()}
    deadlines = {j.id: (j.attempt, j.launch_deadline) for j in state.jobs.values()}
    ledger.load_state(conn, state, settings.fabric.path)
    for node in state.nodes.values():
        node.last_heartbeat = now if initial else max(node.last_heartbeat, beats.get(node.name, 0.0))
    for job in state.running():
        if all(r.state != "ASSIGNED" for r in job.ranks.values()):
            continue
        attempt, deadline = deadlines.get(job.id, (None, None))
        if initial:
            job.launch_deadline = now + settings.launch_timeout
        elif attempt == job.attempt and deadline is not None:
            job.launch_deadline = deadline
        else:
            job.launch_deadline = job.started_at + settings.launch_timeout


def apply_changes(
    conn: Connection, state: SchedulerState, settings: SchedulerSettings, changes: ledger.Changes
) -> None:
    """Bring the view up to date with what other replicas' cycles changed (ledger_changes), reading only those
    rows: the jobs and nodes named, the monotonic node columns as they are. The capacity index follows: the old
    placement of a changed job is given back and its new one taken; a node whose GPUs, topology or MIG layout
    changed rebuilds the index (in memory)."""
    node_ids = set(changes.nodes) | ledger.nodes_of_gpus(conn, changes.gpus)
    rebuild = False
    changed_nodes: list[str] = []
    for name, new in ledger.read_node_records(conn, settings.fabric.path, node_ids).items():
        old = state.nodes.get(name)
        if old is None or _capacity_shape(old) != _capacity_shape(new):
            rebuild = True
        if old is not None:
            new.last_heartbeat = max(new.last_heartbeat, old.last_heartbeat)
            new.persisted_heartbeat = max(new.persisted_heartbeat, old.persisted_heartbeat)
        state.nodes[name] = new
        changed_nodes.append(name)
    if changes.beats or changes.acks or changes.revisions:
        by_id = {n.id: n for n in state.nodes.values()}
        for node_id, ts in changes.beats.items():
            if (node := by_id.get(node_id)) is not None:
                node.last_heartbeat = max(node.last_heartbeat, ts)
                node.persisted_heartbeat = max(node.persisted_heartbeat, ts)
        for node_id, acked in changes.acks.items():
            if (node := by_id.get(node_id)) is not None:
                node.acked_revision = max(node.acked_revision, acked)
        for node_id, revision in changes.revisions.items():
            if (node := by_id.get(node_id)) is not None:
                node.revision = max(node.revision, revision)
    if changes.jobs:
        names = {n.id: n.name for n in state.nodes.values()}
        fresh = ledger.read_job_records(conn, names, changes.jobs)
        touched_nodes: set[str] = set()
        for job_id in changes.jobs:
            old_job = state.jobs.pop(job_id, None)
            if old_job is not None and old_job.state == "RUNNING" and not rebuild:
                for rep in old_job.replica_placements():
                    state.capacity.release_replica(rep)
                touched_nodes.update(old_job.nodes)
            job = fresh.get(job_id)
            if job is None:
                continue
            if job.state == "RUNNING" and any(r.state == "ASSIGNED" for r in job.ranks.values()):
                same = old_job is not None and old_job.attempt == job.attempt and old_job.launch_deadline is not None
                job.launch_deadline = (
                    old_job.launch_deadline if same and old_job else job.started_at + settings.launch_timeout
                )
            state.jobs[job_id] = job
            if job.state == "RUNNING" and not rebuild:
                for rep in job.replica_placements():
                    if rep.mig_profile or rep.gpu_milli:
                        state.capacity.take_partial(rep)
                    else:
                        state.capacity.take(rep.node, rep.gpus)
        if not rebuild:
            state.hold_fatal_gpus(touched_nodes)
    if changes.jobs:  # their claims, made or ended by the other replica
        for job_id in changes.jobs:
            state.claims.pop(job_id, None)
        state.claims.update(ledger.read_claims(conn, changes.jobs))
    if changes.queues:
        state.queues = ledger.load_queues(conn)
        state.pools = ledger.load_pools(conn)  # the spare pools' rows mark the same change
        state.capacity.lending = frozenset(n for p in state.pools.values() for n in p.nodes())
    if changes.sched:
        state.pass_due = True
    if rebuild:
        state.rebuild_capacity()
    else:
        for name in changed_nodes:
            state.set_node_schedulable(name)


def _capacity_shape(node: NodeRecord) -> tuple:
    """What the capacity index holds of a node besides its use: a change rebuilds the index."""
    return (
        node.gpus,
        node.path,
        node.closeness,
        node.gpu_model,
        node.memory_mib,
        node.mig_gpus,
        tuple(sorted(node.foreign.items())),
        frozenset(node.held_gpus),
        tuple(sorted(node.releasing.items())),
    )
