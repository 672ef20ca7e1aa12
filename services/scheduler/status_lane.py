"""The status lane: what agents report, made durable without waiting behind a decision (issue 35, item 2).

Agents send heartbeats (about one a second each), acks of their assignments and their ranks' states. None of these
is a decision, yet before this lane a rank report was a cycle command: the agent waited for the cycle in flight and
then its own, with a pass over the whole queue in it (at 10,000 pending, a few hundred milliseconds), and every
cycle wrote the heartbeats and acks the handlers had kept in memory (so at 4,096 agents almost every cycle moved the
ledger's generation for them alone).

The lane is one thread with its own database connection. The handlers on the event loop queue rows for it; it
commits them in batches (group commit: whatever was queued while the last batch committed), and answers each rank
report once its row is in. Its transactions never take the clock row (the scheduling lock) and write only what no
cycle holds a lock on:
- rank rows (`job_ranks`, upserted), which cycles no longer write for the reports the lane takes;
- the nodes' `last_heartbeat` and `acked_revision`, raised only, on PostgreSQL with `SKIP LOCKED`: a node row a
  cycle holds is left for the next batch rather than waited for.
(On SQLite, a database with one writer at a time, the lane's commit queues at the file lock behind a cycle's; the
at-size deployment is PostgreSQL.)

The cycle reads the lane's effect: a report that changes what the scheduler decides on (a rank's end, a gang whose
last rank started) is handed to it as a `RankReport(recorded=True)` after the commit, which wakes it; the other
reports reach the view in the next cycle. Their effects are idempotent, so a replica that reloads its view from the
ledger (a restart, a takeover) settles the ranks the lane recorded and no cycle applied (`settle_recorded_ranks`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from sqlalchemy import Connection, Engine

from services.common import metrics

from . import ledger
from .commands import RankReport
from .state import TERMINAL_RANK_STATES, JobRecord, SchedulerState
from .transitions import Cycle

log = structlog.get_logger()

# Heartbeats and acks wait at most this long for a batch to carry them (rank rows never wait: they start one).
BEAT_FLUSH_S = 1.0
# A failed batch (the database away) is tried again after this long; the rank reports in it fail at once (their
# agents retry them), the heartbeats and acks stay queued.
RETRY_S = 0.5


class StatusLane:
    def __init__(self, engine: Engine, name: str = "status") -> None:
        self._engine = engine
        self.name = name  # the metrics' `lane` label: status, or accept (SchedulerService.accept_writer)
        self._cond = threading.Condition()
        self._rows: list[tuple[dict[str, Any], concurrent.futures.Future]] = []
        self._jobs: list[tuple[JobRecord, concurrent.futures.Future]] = []
        self._beats: dict[int, float] = {}
        self._acks: dict[int, int] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-lane", daemon=True)
        self._conn: Connection | None = None
        # What it did (the scheduler's metrics and the benchmarks read these)
        self.batches = 0
        self.rank_rows = 0
        self.accepted = 0  # jobs written PENDING (accept)
        self.deferred_nodes = 0  # node rows a cycle held (PostgreSQL SKIP LOCKED): left for the next batch

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10.0)
        for _, fut in [*self._rows, *self._jobs]:
            _settle(fut, RuntimeError("the status lane stopped before writing it"))
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a broken connection: nothing to keep
                pass

    async def record_rank(self, row: dict[str, Any]) -> None:
        """Queue a rank row (the columns of `job_ranks`) and return once it committed."""
        await self._queued(self._rows, row)

    async def accept(self, job: JobRecord) -> bool:
        """Write a PENDING job (the accept lane: a submission no decision can take now, answered once written).
        False: a job with its request id is in the ledger already (nothing written; the caller answers that one)."""
        return bool(await self._queued(self._jobs, job))

    async def _queued(self, queue: list[tuple[Any, concurrent.futures.Future]], item: Any) -> Any:
        """Queue `item` on `queue` (_rows, _jobs) for the next batch, wake the lane, and return what the batch
        answered for it. (The lane's thread empties these lists in place when it takes a batch: they stay the same
        objects, so a caller's reference is never to a batch already taken.)"""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the status lane is stopping")
            queue.append((item, fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    def note_status(self, beats: dict[int, float], acks: dict[int, int]) -> None:
        """Heartbeat times and acked revisions to raise in the ledger (node id -> value); nobody waits for them."""
        if not beats and not acks:
            return
        with self._cond:
            for node_id, at in beats.items():
                self._beats[node_id] = max(at, self._beats.get(node_id, at))
            for node_id, revision in acks.items():
                self._acks[node_id] = max(revision, self._acks.get(node_id, revision))

    # ---- the lane's thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_beats = time.monotonic() + BEAT_FLUSH_S
        while True:
            with self._cond:
                while not self._stopping and not self._rows and not self._jobs:
                    wait = next_beats - time.monotonic()
                    if wait <= 0:
                        if self._beats or self._acks:
                            break
                        next_beats, wait = time.monotonic() + BEAT_FLUSH_S, BEAT_FLUSH_S  # idle: sleep, not poll
                    self._cond.wait(timeout=wait)
                if self._stopping and not self._rows and not self._jobs:
                    return
                rows, jobs = list(self._rows), list(self._jobs)  # emptied in place: see _queued
                self._rows.clear()
                self._jobs.clear()
                due = time.monotonic() >= next_beats
                beats, acks = (self._beats, self._acks) if due else ({}, {})
                if due:
                    self._beats, self._acks = {}, {}
                    next_beats = time.monotonic() + BEAT_FLUSH_S
            started = time.perf_counter()
            try:
                deferred, written = self._commit([r for r, _ in rows], [j for j, _ in jobs], beats, acks)
                metrics.STATUS_LANE_BATCH.labels(self.name).observe(time.perf_counter() - started)
            except Exception as exc:  # the database away: the reports fail (agents retry), the beats wait
                self._drop_connection()
                log.warning("status_lane_batch_failed", error=str(getattr(exc, "orig", exc))[:300], rows=len(rows))
                for _, fut in [*rows, *jobs]:
                    _settle(fut, exc)
                self.note_status(beats, acks)
                with self._cond:
                    if not self._stopping:
                        self._cond.wait(timeout=RETRY_S)
                continue
            self.batches += 1
            self.rank_rows += len(rows)
            self.accepted += len(written)
            for _, fut in rows:
                _settle(fut, None)
            for job, fut in jobs:
                _settle(fut, None, job.id in written)
            if deferred:
                self.deferred_nodes += len(deferred)
                self.note_status(
                    {k: v for k, v in beats.items() if k in deferred}, {k: v for k, v in acks.items() if k in deferred}
                )

    def _commit(
        self, rows: list[dict[str, Any]], jobs: list[JobRecord], beats: dict[int, float], acks: dict[int, int]
    ) -> tuple[set[int], set[str]]:
        """One transaction: the node columns, the rank rows, the accepted jobs (but those whose request id is
        taken). Returns the nodes left for the next batch, and the ids of the jobs written. The reads that need
        answers (the request ids taken, the node rows free to raise) go first; the writes that need none and the
        commit are then sent together (one round trip on PostgreSQL)."""
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._conn = self._engine.connect()
        conn = self._conn
        with conn.begin() as trans:
            fresh: list[JobRecord] = []
            if jobs:
                taken = set(ledger.find_by_request_ids(conn, [j.request_id for j in jobs if j.request_id]))
                for job in jobs:
                    if job.request_id and job.request_id in taken:
                        continue  # the caller answers the job that has it
                    taken.add(job.request_id or "")
                    job.version = 0
                    fresh.append(job)
            deferred = ledger.raise_node_status(conn, beats, acks)
            with ledger.pipelined(conn):
                if rows:
                    ledger.record_ranks(conn, rows)
                if fresh:
                    ledger.insert_jobs(conn, fresh)
                trans.commit()
            return deferred, {j.id for j in fresh}

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
            except Exception:  # already broken
                pass
            self._conn = None


def _settle(fut: concurrent.futures.Future, error: BaseException | None, result: Any = None) -> None:
    """Answer a waiting caller; it may have gone meanwhile (the RPC was cancelled, so was its future)."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def lane_report(state: SchedulerState, report: RankReport, at: float) -> tuple[str, bool, dict[str, Any] | None]:
    """How the lane takes a rank report, judged on the view from the event loop (reads only; the writer thread owns
    the view, and each read here is one attribute or dict lookup). Returns (what, wake, row):
    - ("stale", _, None): the attempt ended or was superseded: answered at once, nothing written (as the cycle
      answers);
    - ("same", _, None): the rank is in that state already, or ended: answered at once, nothing written;
    - ("record", wake, row): the lane writes `row` (job_ranks' columns), then hands the report to the cycle; `wake`
      when it changes a decision's input (a rank's end; the gang's last rank started, or its held replicas may go);
    - ("cycle", _, None): what the view cannot judge alone (an unknown node or job, an attempt the view has not
      seen, a rank not on that node): the cycle command as before, which reads the ledger or gives the error."""
    node = state.nodes.get(report.node)
    if node is None:
        return "cycle", True, None
    job = state.jobs.get(report.job_id)
    if job is None:
        return ("stale", False, None) if report.job_id in state.ended else ("cycle", True, None)
    attempt, job_state = job.attempt, job.state
    if attempt > report.attempt:
        return "stale", False, None
    if attempt != report.attempt or job_state != "RUNNING":
        return "cycle", True, None
    rank = job.ranks.get(report.rank)
    if rank is None or rank.node != report.node:
        return "cycle", True, None
    if rank.state in TERMINAL_RANK_STATES or rank.state == report.state:
        return "same", False, None
    row = report.row(rank, node.id, at)
    if report.state != "RUNNING":
        return "record", True, row
    others_waiting = any(r.state == "ASSIGNED" for r in list(job.ranks.values()) if r.rank != report.rank)
    return "record", not others_waiting or bool(job.placement.get("held")), row


def settle_recorded_ranks(
    cycle: Cycle,
    on_error: Callable[[str, Exception], None] | None = None,
    job_ids: Iterable[str] | None = None,
) -> int:
    """After the leader read jobs from the ledger (all of them, or `job_ids`, another replica's changes): apply the
    ranks' states that no cycle of its own applied. The replica whose lane recorded them stopped first; or the
    gang's ranks report to two replicas (their agents are connected to different ones), and the last report went to
    the other replica, whose view did not have this lane's rows yet (they are announced only once a cycle here
    applies them). A running gang with an ended rank is torn down as that report would have done; after a whole
    reload, one whose ranks all run gets its start too. Returns how many reports it applied."""
    applied = 0
    if job_ids is None:
        jobs = list(cycle.state.running())
    else:
        jobs = [j for j in (cycle.state.jobs.get(i) for i in job_ids) if j is not None and j.state == "RUNNING"]
    for job in jobs:
        ranks = list(job.ranks.values())
        ended = [r for r in ranks if r.state in TERMINAL_RANK_STATES]
        if ended:  # the first failure decides, as its report would have; an exit with 0 ends it only with all
            picks = sorted(ended, key=lambda r: (r.state == "EXITED" and r.exit_code == 0, r.rank))[:1]
        elif job_ids is None and ranks and not job.running_at and all(r.state == "RUNNING" for r in ranks):
            picks = ranks[:1]
        else:
            continue
        r = picks[0]
        report = RankReport(r.node, job.id, job.attempt, r.rank, r.state, r.exit_code, "", 0, recorded=True)
        try:
            report.execute(cycle)
            applied += 1
        except Exception as exc:  # one gang must not stop the others being settled
            if on_error is not None:
                on_error(job.id, exc)
    if applied:
        log.info("recorded_ranks_settled", reports=applied)
    return applied
