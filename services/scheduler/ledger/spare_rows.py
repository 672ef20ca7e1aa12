"""The ledger's side of a spare swap (services/scheduler/spares.py): one attempt's allocation rows rewritten in the
cycle's transaction, so that the GPUs of the gang and of its spares never leave the ledger in between."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, or_, update

from db.models import Allocation

from ._sql import _changed_jobs, _changed_nodes
from .allocations import _give_back_use


def rewrite_spare_rows(
    conn: Connection,
    job_id: str,
    attempt: int,
    dead_node: int | None,
    dropped: Sequence[int],
    relabel: Mapping[int, int],
    next_attempt: bool,
    now: float,
) -> None:
    """Release the attempt's rows on node `dead_node` (an id; None: none) and those of the replicas `dropped`,
    giving their host resources back; re-label the spare rows of `relabel` (spare replica -> the replica it takes
    over); with `next_attempt`, move every row still held to attempt + 1 (the restarted gang's)."""
    _changed_jobs(conn, job_id)
    held = (Allocation.job_id == job_id, Allocation.attempt == attempt, Allocation.released_at.is_(None))
    gone = []
    if dead_node is not None:
        _changed_nodes(conn, dead_node)
        gone.append(Allocation.node_id == dead_node)
    if dropped:
        gone.append(Allocation.replica.in_(sorted(dropped)))
    if gone:
        node_part = "a.node_id = :dead" if dead_node is not None else "1 = 0"
        replica_part = f"a.replica IN ({', '.join(str(int(r)) for r in dropped)})" if dropped else "1 = 0"
        _give_back_use(conn, job_id, attempt, f"({node_part} OR {replica_part})", dead=dead_node)
        conn.execute(update(Allocation).where(*held, or_(*gone)).values(released_at=now))
    for spare, replica in sorted(relabel.items()):
        conn.execute(update(Allocation).where(*held, Allocation.replica == spare).values(replica=replica))
    if next_attempt:
        conn.execute(update(Allocation).where(*held).values(attempt=attempt + 1))
