"""Loading the whole view: the nodes, jobs, claims and queues the ledger holds now, swapped in at once."""

from __future__ import annotations

from sqlalchemy import Connection

from ..state import SchedulerState
from .allocations import recount_use
from .claims import read_claims
from .jobs import read_job_records
from .nodes import read_node_records
from .pools import load_pools
from .queues import load_queues


def load_state(conn: Connection, state: SchedulerState, fabric_path) -> None:
    """Replace the in-memory view with what the ledger holds now (built aside, then swapped in at once)."""
    recount_use(conn)
    nodes = read_node_records(conn, fabric_path)
    jobs = read_job_records(conn, {n.id: n.name for n in nodes.values()})
    state.nodes, state.jobs = nodes, jobs
    state.claims = read_claims(conn)
    state.queues = load_queues(conn)
    state.pools = load_pools(conn)
    state.rebuild_capacity()
