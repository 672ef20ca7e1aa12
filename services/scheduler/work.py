"""A scheduling cycle's unit of work: the only holder of its connection, and every write it queues.

The job life cycle (transitions.py, commands.py, planning.py, migmode.py) changes the in-memory view and hands
its SQL here: `write(statement, *args)` queues a write with no answer, `ask(statement, *args)` applies the queue and
then a read, or a guarded write whose answer a transition needs (`read` for a read that locks nothing: it need not
wait for the clock row's lock, see `fence`); `later(statement, *args)` defers a write to the
cycle's end (batched, pipelined), and the queues below (new jobs and allocations, assignments, rank reports, claims,
heartbeats and acks) are the closing writes of cycle.py. A statement is a function of services/scheduler/ledger
(or accounting) taking the connection first. Queued writes are applied in the order they were queued, before any
read (`ask`), before the deferred ones (`write_deferred`) and at the cycle's end (`apply`, from finish_cycle), so
the statements of a cycle reach the ledger in the order the transitions issue them, in the same transaction.

Because nothing else holds the connection, a stand-in without one (tests/unit/test_job_lifecycle.py) runs the
job state machine with no database: it records the writes and answers the questions from a table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select

from db.models import Job

from . import ledger
from .state import JobRecord, NodeRecord

# A deferred write -> the same write for the many rows of a cycle (write_deferred)


def _end_attempts(conn: Connection, rows: list[tuple[Any, ...]]) -> None:
    ledger.end_attempts(conn, [(job, outcome, reason, now) for job, outcome, reason, now, _answer in rows])


_BATCHED: dict[Any, Callable[[Connection, Any], None]] = {
    ledger.end_attempt: _end_attempts,
    ledger.release_allocations: ledger.release_allocations_many,
    ledger.mark_attempt_running: ledger.mark_attempts_running,
}


# Queued "writes" that only record what the cycle's closing writes will send (no SQL now): applying them needs no fence
_LOCAL = frozenset({ledger.queue_job_update})


def job_row(conn: Connection, job_id: str) -> Any:
    """The job's (state, attempt) as the ledger has it now (None: no such job), its deferred updates written
    first: a job this cycle finished or requeued reads so."""
    ledger.flush_job_updates(conn)
    return conn.execute(select(Job.state, Job.attempt).where(Job.id == job_id)).first()


@dataclass
class UnitOfWork:
    conn: Connection
    # Heartbeats and acks to persist (node id -> the new value), written among the closing writes
    heartbeats: dict[int, float] = field(default_factory=dict)
    acks: dict[int, int] = field(default_factory=dict)
    # The ledger generation this cycle builds on, then the one its commit makes (ledger.bump_generation)
    generation: int = 0
    # Jobs submitted in this cycle are written once, after scheduling, in their final state (often RUNNING).
    new_jobs: list[JobRecord] = field(default_factory=list)
    new_allocations: list[JobRecord] = field(default_factory=list)
    # Spares booked again for running gangs (services/scheduler/spares.py): their rows, written with the reservations
    new_spares: list[JobRecord] = field(default_factory=list)
    # Assignments queued for nodes (send), and those written (flush): (node, revision, message), for the fan-out
    outbox: list[tuple[NodeRecord, str, int, str, Any]] = field(default_factory=list)
    delivered: list[tuple[str, int, Any]] = field(default_factory=list)
    # Rank reports to store (ledger.record_ranks), written together before the commit or a reload
    rank_rows: list[dict[str, Any]] = field(default_factory=list)
    # Writes nothing in the cycle reads back or needs an answer from (an attempt's end, its running mark, a
    # teardown's released allocations): sent together, pipelined, before the closing reads (write_deferred)
    deferred: list[tuple[Any, tuple[Any, ...]]] = field(default_factory=list)
    # What this cycle's writes changed (ledger.track_changes), stored with its generation for the other replicas
    changes: ledger.Changes | None = None
    # Claims made and ended, in order: written after this cycle's new jobs (a claimant may be one of them)
    claim_writes: list[tuple[Any, tuple[Any, ...]]] = field(default_factory=list)
    # Writes queued by `write`, not applied yet: (statement, args, keyword args)
    queue: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    # The clock row's checked lock when the cycle did not wait for it before deciding (ledger.fence, the service's
    # fence in the pipeline): sent before the cycle's first statement that may write, so it is the first row the
    # transaction locks. None once sent, and for a cycle that took the lock first (ledger.begin_cycle).
    fence: Callable[[], None] | None = None
    fence_waited: bool = False  # the fence was sent alone, before the closing pipeline (a guarded write needed it)

    # ---- the statements -------------------------------------------------------------------------------------------

    def write(self, statement: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue a write whose answer nobody needs (applied, in order, before the next read or at `apply`)."""
        self.queue.append((statement, args, kwargs))

    def ask(self, statement: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Apply the queued writes, then a read or a guarded write, and return its answer."""
        self.take_fence()
        self.apply()
        return statement(self.conn, *args, **kwargs)

    def read(self, statement: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Apply the queued writes, then a read that locks nothing, and return its answer. Unlike `ask`, it does not
        send the fence first: a cycle that decides before the clock row's lock reads without waiting for it (what
        it read is checked at its commit, by the fence's generation)."""
        self.apply()
        return statement(self.conn, *args, **kwargs)

    def take_fence(self) -> None:
        """Send the fence if it is still owed (before anything that may lock a row: every writer locks the clock row
        first). Outside the closing pipeline it waits for the lock, as a cycle that took it first did."""
        if self.fence is not None:
            send, self.fence = self.fence, None
            self.fence_waited = not ledger.in_pipeline(self.conn)
            send()

    def apply(self) -> None:
        """Apply the queued writes, in the order they were queued."""
        if self.fence is not None and any(statement not in _LOCAL for statement, _, _ in self.queue):
            self.take_fence()
        while self.queue:
            items, self.queue = self.queue, []
            for statement, args, kwargs in items:
                statement(self.conn, *args, **kwargs)

    def later(self, statement: Callable[..., Any], *args: Any) -> None:
        """Queue `statement(conn, *args)` for write_deferred (args are taken now: pass copies of what may change)."""
        self.deferred.append((statement, args))

    def claim(self, statement: Callable[..., Any], *args: Any) -> None:
        """Queue a claim's write (ledger.set_claim or ledger.end_claim) for write_claims."""
        self.claim_writes.append((statement, args))

    def send(self, node: NodeRecord, job_id: str, attempt: int, kind: str, build) -> None:
        """Queue an assignment for `node`; all of a cycle's are written by `flush`."""
        self.outbox.append((node, job_id, attempt, kind, build))

    # ---- applying the queues --------------------------------------------------------------------------------------

    @property
    def needs_answers(self) -> bool:
        """Whether the closing writes need their row counts: a partial GPU (ledger._hold) or host resources
        (ledger._take_use) were reserved, each under a guarded update."""
        return any(job.partials or job.cpu_milli or job.memory for job in (*self.new_allocations, *self.new_spares))

    def flush(self, nodes: dict[str, NodeRecord], now: float) -> None:
        """Write the queued assignments (their revisions are on `nodes`, the view's current records)."""
        if self.outbox:
            # The view may have been reloaded since an item was queued: revisions live on the current records.
            items = [(nodes.get(n.name, n), *rest) for n, *rest in self.outbox]
            self.delivered += self.ask(ledger.append_assignments, items, now)
            self.outbox = []

    def write_claims(self) -> None:
        writes, self.claim_writes = self.claim_writes, []
        for statement, args in writes:
            self.write(statement, *args)

    def write_deferred(self) -> None:
        """Apply the queue, then the jobs' updates (compare-and-set) and the deferred writes. The caller runs it at
        the start of the cycle's closing writes, in their pipeline on PostgreSQL: the updates need no answer there,
        the server fails the transaction when one finds its row moved (ledger.flush_job_updates, checked_by_server),
        so they, the deferred writes, the closing writes and the COMMIT are one round trip. Nothing read after them
        in the cycle depends on them. The queue must be applied before the pipeline: a queued write may read
        (ledger.request_checkpoint), and a read in a pipeline gets no rows."""
        self.take_fence()
        self.apply()
        ledger.flush_job_updates(self.conn, checked_by_server=True)
        items, self.deferred = self.deferred, []
        # The usual ones are written as one statement each for the whole cycle, not one per job (they touch
        # different rows or columns, so their order does not matter).
        batches: dict[Any, list[tuple[Any, ...]]] = {}
        for statement, args in items:
            if statement in _BATCHED:
                batches.setdefault(statement, []).append(args)
            else:
                self.write(statement, *args)
        for statement, rows in batches.items():
            self.write(_BATCHED[statement], rows)
        self.apply()

    def flush_ranks(self) -> None:
        if self.rank_rows:
            self.write(ledger.record_ranks, self.rank_rows)
            self.rank_rows = []
