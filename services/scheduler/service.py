"""The scheduler replica: an inbox of commands, one writer thread running cycles, and the fan-out after commit.

Event-driven: a submit, a release or an agent report wakes the loop at once; it drains everything queued since
its last cycle into one transaction (group commit). After the commit it answers callers, pushes job events to
watchers and wakes the assignment streams of the nodes that got work. Other replicas learn of the change through
PostgreSQL LISTEN/NOTIFY (sent inside the transaction, so only committed work is announced).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from db.engine import is_sqlite, make_engine
from phalanx.api.v1 import common_pb2
from services.common import metrics
from services.common.errors import ServiceError, Unavailable
from services.common.faults import fail_point

from . import accounting, ledger, retention
from .commands import Adopt, Submit, check_submission, new_job
from .convert import job_from_record, job_from_row, node_from_row
from .cycle import finish_cycle, run_cycle
from .fanout import FanOut
from .leadership import Leadership
from .node_intake import NodeIntake, log_failure
from .settings import SchedulerSettings
from .state import SchedulerState
from .status_lane import StatusLane, settle_recorded_ranks
from .transitions import Command, Cycle
from .viewsync import apply_changes, reload_state
from .work import UnitOfWork

log = structlog.get_logger()
# A cycle longer than this logs where its time went (cycle_slow); PHALANX_SLOW_CYCLE_MS sets it (0: every cycle).
SLOW_CYCLE_S = float(os.environ.get("PHALANX_SLOW_CYCLE_MS", "250")) / 1000
# After another replica's notice (a write, or a follower saying it is here at each lease tick), a cycle that found
# the generation moved, or a refused fence, cycles wait for the clock row's lock before deciding for this long (at
# least a lease): the fence in the pipeline pays off only while this replica is the ledger's one writer, and a
# refusal costs a full reload of the view.
FENCE_QUIET_S = 10.0


class SchedulerService:
    def __init__(self, settings: SchedulerSettings) -> None:
        if not settings.replica_id:
            settings = type(settings)(**{**settings.__dict__, "replica_id": uuid.uuid4().hex[:8]})
        self.settings = settings
        # The time cycles decide at (time limits, backoffs, leases, preemption deadlines; every timestamp they write):
        # the wall clock, unless a test drives its own (SchedulerSettings.clock).
        self.clock = settings.clock
        # A session idle inside a transaction this long is ended by PostgreSQL: a stopped leader cannot hold the
        # clock row (and so the others' takeover) much past its lease.
        self.engine: Engine = make_engine(
            settings.db_url, pool_size=12, idle_in_transaction_timeout_s=max(2.0, 2 * settings.leader_lease_s)
        )
        # Reads (lists, goodput, assignment streams) take no lock the others wait for: a long one on a busy replica
        # must not be ended by that timeout.
        self.read_engine: Engine = make_engine(settings.db_url, pool_size=8)
        self.state = SchedulerState()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ledger-writer")
        # Rank reports, heartbeats and acks reach the ledger there, never behind a cycle (status_lane.py)
        self.status_lane = StatusLane(self.engine) if settings.status_lane else None
        # Accepted submissions (submit) are written by a lane of their own, with its own thread and connection: a
        # submission never waits behind a batch of rank rows and heartbeats (their SKIP LOCKED reads, their upserts).
        self.accept_writer = (
            StatusLane(self.engine, "accept") if settings.status_lane and settings.accept_lane else None
        )
        self._readers = ThreadPoolExecutor(8, thread_name_prefix="ledger-reader")
        self._inbox: list[tuple[Command, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._resync = True
        self._initial = True
        self._last_sync = 0.0
        self._generation: int | None = None
        self._writer_conn = None
        self._next_gauges = 0.0
        self._next_goodput = 0.0
        self._next_retention = 0.0  # the next run of _retention
        # The leader's accounting of finished jobs, off the cycle (_account_soon): its timer, whether it runs, and
        # whether jobs finished while it ran
        self._account_timer: asyncio.TimerHandle | None = None
        self._accounting = False
        self._account_again = False
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._listener: threading.Thread | None = None
        self.fanout = FanOut(settings.watch_queue)
        # What the agents say between cycles: heartbeats, health, MIG modes, acks, rank reports (node_intake.py)
        self.intake = NodeIntake(self)
        self._watchdog: asyncio.Task | None = None
        self._next_timer_check = 0.0
        self._next_changes_prune = 0.0
        self.cycle_id = 0  # the last cycle's number in this process: bound as `cycle` in its log lines
        self.view_reloads = {"full": 0, "delta": 0}  # this replica's (phalanx_scheduler_view_reloads_total)
        # Transactions by how they held the clock row (_fence_ahead; phalanx_scheduler_fences_total)
        self.fences = {"lock": 0, "pipeline": 0, "waited": 0, "refused": 0}
        # (monotonic) no fence in the pipeline before then: another replica was heard. From the start, until its
        # followers, each saying it is here every third of a lease, had two chances to be heard.
        self._fence_quiet_s = max(FENCE_QUIET_S, settings.leader_lease_s)
        self._fence_off_until = time.monotonic() + settings.leader_lease_s * 2 / 3
        self._must_lock = True  # this cycle reads the clock row first whatever (a lease tick, the periodic look)
        self._db_clock_offset = 0.0  # the database's clock minus this host's, as the last clock row read found it
        # Batches of submits by where they were decided, and the gangs the lane reserved (admission_lane.py)
        self.admissions = {"lane": 0, "pass": 0, "accept": 0, "admitted_at_submit": 0}
        self.lane_skips: collections.Counter[str] = collections.Counter()  # why batches went to the pass
        self._loop: asyncio.AbstractEventLoop | None = None
        self.leadership = Leadership(settings.replica_id, settings.leader_lease_s)

    @property
    def leading(self) -> bool:
        """Whether this replica holds the leadership lease (as of its last cycle): it alone schedules."""
        return self.leadership.leading

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watchdog = asyncio.create_task(self.intake.stalls.watch(), name="scheduler-stall-watchdog")
        for lane in (self.status_lane, self.accept_writer):
            if lane is not None:
                lane.start()
        await self._loop.run_in_executor(self._writer, self._cycle_once, [])
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")
        if not is_sqlite(self.engine):
            await self._loop.run_in_executor(self._readers, self._check_server)
            self._listener = threading.Thread(target=self._listen, name="pg-listener", daemon=True)
            self._listener.start()
        log.info(
            "scheduler_started",
            replica=self.settings.replica_id,
            nodes=len(self.state.nodes),
            active_jobs=len(self.state.jobs),
        )

    def _check_server(self) -> None:
        """Warn about a PostgreSQL server set up against the ledger's write pattern: a scheduler deletes and updates
        rows all day, and without autovacuum the planner keeps the statistics of an empty ledger and dead rows
        pile up (the archive's scans and deletes then cost seconds each)."""
        try:
            with self.read_engine.connect() as conn:
                autovacuum = conn.exec_driver_sql("SHOW autovacuum").scalar()
        except DBAPIError as exc:
            log.warning("server_check_failed", error=_db_error(exc))
            return
        if autovacuum != "on":
            log.warning(
                "postgresql_autovacuum_off",
                note="the ledger's server runs without autovacuum: turn it on, or VACUUM (ANALYZE) the ledger "
                "regularly (query plans degrade as the tables churn)",
            )

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._watchdog:
            self._watchdog.cancel()
        if self._account_timer is not None:
            self._account_timer.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for _, fut in self._inbox:
            if not fut.done():
                fut.set_exception(Unavailable("the scheduler is shutting down"))
        self.fanout.wake_all_nodes()
        self._writer.submit(self._release_leadership)
        self._writer.submit(self._close_writer_connection)
        self._writer.shutdown(wait=True)
        for lane in (self.status_lane, self.accept_writer):
            if lane is not None:
                lane.stop()
        self._readers.shutdown(wait=False)
        self.engine.dispose()
        self.read_engine.dispose()

    # ---- commands ------------------------------------------------------------------------------------------------

    async def execute(self, command: Command) -> Any:
        """Queue a command for the next cycle and wait until its transaction committed."""
        if self._stopping:
            raise Unavailable("the scheduler is shutting down")
        fut = asyncio.get_running_loop().create_future()
        self._inbox.append((command, fut))
        self._wake.set()
        result = await fut
        if isinstance(result, ServiceError):
            raise result
        return result

    async def submit(self, sub: Submit) -> Any:
        """A submission. One that no decision can take now (a PENDING job of its priority or a higher one is ahead of
        it, so it waits for a pass whatever happens) is accepted on the leader: written PENDING by a lane of its own
        (accept_writer, a StatusLane that writes nothing else), in a transaction that takes no scheduling lock, and
        answered then; the next cycle adopts it into the view
        (Adopt) and the pass decides it. The others go to the writer: decided at submit (the admission lane) or by
        the pass. Either way the reply is the job as written."""
        lane = self.accept_writer
        if (
            lane is None
            or not self.leading
            or self._resync
            or self._stopping
            or self._loop is None
            or not accept_eligible(self.state, sub)
        ):
            return await self.execute(sub)
        try:
            check_submission(self.state, self.settings, sub)  # reads of the view the writer may change meanwhile
        except Exception:  # an error, or a read that raced the writer: the cycle says it, on a consistent view
            return await self.execute(sub)
        job = new_job(sub, self.clock())
        try:
            written = await lane.accept(job)
        except Exception as exc:  # it may have committed all the same: the view is reloaded before it is trusted
            self._resync = True
            log.warning("accept_failed", error=str(exc)[:200])
            return await self.execute(sub)
        if not written:  # its request id is taken: the cycle answers the job that has it
            return await self.execute(sub)
        self.admissions["accept"] += 1
        metrics.ADMISSIONS.labels("accept").inc()
        self.enqueue(Adopt(job), functools.partial(log_failure, "adopt_failed", job.id))
        return job_from_record(job)

    def enqueue(self, command: Command, on_done: Callable[[asyncio.Future], None], *, wake: bool = True) -> bool:
        """Queue a command no caller waits for (`on_done` gets its future when the cycle took it); `wake`: have the
        loop run a cycle for it now. False (nothing queued) once the service stops or before it started."""
        if not self.accepting or self._loop is None:
            return False
        fut = self._loop.create_future()
        fut.add_done_callback(on_done)
        self._inbox.append((command, fut))
        if wake:
            self._wake.set()
        return True

    @property
    def accepting(self) -> bool:
        """Whether commands may be queued (the service runs and does not stop)."""
        return not self._stopping and self._loop is not None

    @property
    def view_trusted(self) -> bool:
        """Whether the view is this replica's own, not waiting to be reloaded from the ledger."""
        return not self._resync

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._next_timeout())
            except TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                break
            batch, self._inbox = self._inbox, []
            commands = [c for c, _ in batch]
            # Nothing but submits: the admission lane may decide them on their own (checked under the lock)
            admission = self.settings.admission_lane and bool(commands) and all(isinstance(c, Submit) for c in commands)
            try:
                results, outcome = await loop.run_in_executor(self._writer, self._cycle_once, commands, admission)
            except Exception as exc:  # the loop must survive anything
                log.error("cycle_failed", error=str(exc)[:500])
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(Unavailable("the ledger is unavailable; nothing was written, try again"))
                await asyncio.sleep(0.2)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)
            if outcome is not None:
                self._after_commit(outcome)

    def _next_timeout(self) -> float:
        return 0.25

    def _cycle_once(self, commands: list[Command], admission: bool = False) -> tuple[list[Any], Cycle | None]:
        """Runs in the writer thread. One transaction; on failure, reload and retry commands one by one."""
        wall, now = time.time(), self.clock()  # how often to look (the wall's), and the cycle's time (settings.clock)
        # Other processes' writes are caught by the generation check; polling only bounds how late we notice them.
        periodic = wall - self._last_sync >= (self.settings.poll_interval if is_sqlite(self.engine) else 5.0)
        self._timers = wall >= self._next_timer_check
        if self._timers:
            self._next_timer_check = wall + 0.2
        lease_tick = self.leadership.tick_due(wall)
        self._must_lock = periodic or lease_tick  # the lease is renewed, other writers looked for, under the lock
        timers = self._timers and self.leading and self._timers_due(now)
        if not commands and not self._resync and not periodic and not timers and not lease_tick:
            return [], None
        self.cycle_id += 1
        # Every log line of the cycle, its retries included, carries its id (phalanx.common.logging merges it).
        with structlog.contextvars.bound_contextvars(cycle=self.cycle_id):
            return self._cycle_attempts(commands, now, admission)

    def _cycle_attempts(
        self, commands: list[Command], now: float, admission: bool = False
    ) -> tuple[list[Any], Cycle | None]:
        """The cycle's transaction; on failure, once again on a reloaded view (as a cycle, never the admission lane),
        then the commands one by one."""
        try:
            return self._transaction(commands, now, resync=self._resync, admission=admission)
        except (DBAPIError, ledger.StaleJobs) as exc:
            self._resync = True
            if ledger.fence_refused(exc):
                # Another writer since this replica's last commit, or its lease lost: nothing committed, and the
                # retry below takes the lock first, on a reloaded view (and so do cycles for a while).
                self._fence_off_until = time.monotonic() + self._fence_quiet_s
                self.fences["refused"] += 1
                metrics.FENCES.labels("refused").inc()
                log.info("fence_refused", error=_db_error(exc), commands=len(commands))
            else:
                log.warning("cycle_rolled_back", error=_db_error(exc), commands=len(commands))
        except Exception:
            # A bug (a check of the view such as core.capacity's CapacityError). Nothing of the cycle committed but
            # the view may hold its changes: reload it. One command, or the pass, must not fail every caller: each
            # command runs alone, without the pass (the next cycle runs that, and logs it if it fails again).
            self._resync = True
            log.exception("cycle_failed", commands=len(commands))
            if not commands:
                return [], None
            return self._one_by_one(commands, schedules=False)
        # The usual cause is a stale view (a writer the generation did not reveal): nothing of the cycle
        # committed, so run it again once on a view reloaded from the ledger.
        try:
            return self._transaction(commands, self.clock(), resync=True)
        except (DBAPIError, ledger.StaleJobs) as exc:
            self._resync = True
            log.warning("cycle_rolled_back_again", error=_db_error(exc), commands=len(commands))
            if not commands:
                raise
        # Still refused: isolate the command at fault, so the others go through.
        return self._one_by_one(commands)

    def _one_by_one(self, commands: list[Command], *, schedules: bool = True) -> tuple[list[Any], Cycle | None]:
        """Each command in a transaction of its own, on a reloaded view: the one at fault fails alone."""
        results: list[Any] = []
        merged: Cycle | None = None
        for command in commands:
            try:
                (result,), cycle = self._transaction([command], self.clock(), resync=True, schedules=schedules)
                merged = _merge(merged, cycle)
                results.append(result)
            except (DBAPIError, ledger.StaleJobs) as exc:
                self._resync = True
                log.error("command_refused_by_ledger", command=type(command).__name__, error=_db_error(exc))
                results.append(Unavailable("the ledger refused the change; nothing was written, try again"))
            except Exception:
                self._resync = True
                log.exception("command_failed", command=type(command).__name__)
                results.append(ServiceError("the scheduler failed on this request (logged); nothing was written"))
        return results, merged

    def _writer_connection(self):
        """The writer thread keeps one connection: no pool checkout and liveness ping on every cycle."""
        if self._writer_conn is None or self._writer_conn.closed or self._writer_conn.invalidated:
            self._writer_conn = self.engine.connect()
        return self._writer_conn

    def _transaction(
        self, commands: list[Command], now: float, *, resync: bool, schedules: bool = True, admission: bool = False
    ) -> tuple[list[Any], Cycle]:
        conn = self._writer_connection()
        started = time.perf_counter()
        try:
            out = self._transaction_on(conn, commands, now, resync=resync, schedules=schedules, admission=admission)
            metrics.CYCLE_SECONDS.observe(time.perf_counter() - started)
            return out
        except Exception:
            with contextlib.suppress(Exception):
                conn.invalidate()
            self._writer_conn = None
            raise

    def _transaction_on(
        self,
        conn,
        commands: list[Command],
        now: float,
        *,
        resync: bool,
        schedules: bool = True,
        admission: bool = False,
    ) -> tuple[list[Any], Cycle]:
        """`schedules` False: the commands only, without timers and the pass (as on a replica that does not lead).
        `admission`: a batch of submits the admission lane may decide alone, if the view it holds under the lock is
        this replica's own (no other writer since its last commit, nothing reloaded) and settled (run_cycle)."""
        t0 = time.perf_counter()
        conn.info.pop(ledger.JOB_WRITES, None)  # nothing of a cycle that did not commit carries over
        fenced = self._fence_ahead(resync)
        with conn.begin() as trans:
            if fenced:
                # The view is this replica's own as of its last commit, and it leads: decide on it now, and let the
                # server check that with the lock (ledger.fence), sent before the cycle's first write.
                assert self._generation is not None and self.leadership.epoch is not None
                clock = ledger.Clock(
                    self._generation,
                    self.leadership.replica,
                    self.leadership.epoch,
                    self.leadership.until,
                    time.time() + self._db_clock_offset,
                )
                epoch: int | None = clock.epoch
                until, acquired = clock.until, False
            else:
                clock = ledger.begin_cycle(conn)
                self._db_clock_offset = clock.now - time.time()
                epoch, until, acquired = self.leadership.decide(conn, clock)
                self._last_sync = time.time()
            t_lock = time.perf_counter()
            generation = clock.generation
            # The cycle's clock starts once it holds the ledger: a cycle of another replica that waited for the
            # lock must not stamp a reservation earlier than the release it builds on. (A fenced cycle commits only
            # if no other writer committed since this replica's last cycle, which started later than theirs.)
            now = max(now, self.clock())
            cycle = Cycle(UnitOfWork(conn), self.state, self.settings, now)
            if fenced:
                cycle.work.fence = functools.partial(ledger.fence, conn, generation, clock.leader, clock.epoch)
            cycle.foreign_writes = self._generation is not None and generation != self._generation
            if cycle.foreign_writes:
                self._fence_off_until = time.monotonic() + self._fence_quiet_s
            if epoch is None and self._must_lock and schedules:
                cycle.work.write(ledger.announce, self.settings.replica_id)  # a follower's lease tick: "I am here"
            changes = None
            if cycle.foreign_writes and not resync and not acquired:
                changes = ledger.read_changes(conn, self._generation or 0, generation)
            if changes is not None:
                # Other replicas wrote: reload only what they changed (their cycles recorded it).
                apply_changes(conn, self.state, self.settings, changes)
                cycle.foreign_assigned = changes.assigned
                if self.status_lane is not None and epoch is not None and schedules and changes.jobs:
                    cycle.settle_jobs = list(changes.jobs)  # their ranks may have ended on both replicas
                metrics.VIEW_RELOADS.labels("delta").inc()
                self.view_reloads["delta"] += 1
            elif resync or generation != self._generation or acquired:
                # A new leader gives every node a full lease and every launch its timeout from now, as a restart
                # does: heartbeats that reached the old leader last may not be in the ledger yet.
                reload_state(conn, self.state, self.settings, now, initial=self._initial or acquired)
                cycle.foreign_assigned = None  # unknown: every stream looks
                cycle.settle_ranks = self.status_lane is not None and epoch is not None and schedules
                metrics.VIEW_RELOADS.labels("full").inc()
                self.view_reloads["full"] += 1
            t_view = time.perf_counter()
            cycle.work.changes = ledger.track_changes(conn)
            self.intake.take_beats_and_acks(cycle)
            cycle.work.generation = generation
            cycle.epoch = epoch or 0
            if cycle.settle_ranks or cycle.settle_jobs:  # ranks the lane recorded that no cycle here applied
                settle_recorded_ranks(
                    cycle,
                    lambda job, exc: log.warning("settle_failed", job=job, error=str(exc)),
                    None if cycle.settle_ranks else cycle.settle_jobs,
                )
            lane = admission and not resync and not acquired and generation == self._generation
            results = run_cycle(
                cycle,
                commands,
                timers_due=self._timers,
                schedules=schedules and epoch is not None,
                admission=lane,
                timers_pending=lambda: self._timers_due(now),
            )
            if admission and not lane and cycle.metrics.admission_path == "" and epoch is not None:
                cycle.metrics.admission_path = "pass"
                cycle.metrics.lane_skipped = "another writer changed the ledger" if changes else "the view was reloaded"
            t_run = time.perf_counter()
            if self.leading and now >= self._next_changes_prune:
                self._next_changes_prune = now + 30.0
                cycle.work.take_fence()
                ledger.prune_changes(conn, now - ledger.CHANGES_KEPT_S)
            # The jobs' compare-and-set updates, the deferred and the closing writes, and the commit: one round trip
            # on PostgreSQL (the server refuses a stale update: UnitOfWork.write_deferred). Not when a MIG instance
            # or share was reserved: the guarded update of its GPU's hold row must see its row count (ledger._hold).
            cycle.work.apply()  # the queued writes first, outside it: some read (ledger.request_checkpoint)
            with ledger.pipelined(conn, enabled=not cycle.work.needs_answers):
                cycle.work.write_deferred()
                t_deferred = time.perf_counter()
                finish_cycle(cycle, commands, results)
                if cycle.handover:
                    fail_point("scheduler.handover")
                trans.commit()
            self.state.note_ended(cycle.finished)  # committed: their ranks' late reports are answered from memory
        how = ("waited" if cycle.work.fence_waited else "pipeline") if fenced else "lock"
        self.fences[how] += 1
        metrics.FENCES.labels(how).inc()
        done = time.perf_counter()
        if done - t0 > SLOW_CYCLE_S:
            cycle.metrics.timings.update(
                deferred_ms=round((t_deferred - t_run) * 1000, 1),
                closing_ms=round((done - t_deferred) * 1000, 1),
            )
            log.info(
                "cycle_slow",
                ms=round((done - t0) * 1000, 1),
                lock_ms=round((t_lock - t0) * 1000, 1),
                view_ms=round((t_view - t_lock) * 1000, 1),
                run_ms=round((t_run - t_view) * 1000, 1),
                commit_ms=round((done - t_run) * 1000, 1),
                commands=len(commands),
                view="delta" if changes is not None else ("full" if cycle.foreign_assigned is None else "kept"),
                fence=how,
                reserved=len(cycle.metrics.reserved),
                **cycle.metrics.timings,
            )
        self._generation = cycle.work.generation
        self._initial = False
        self._resync = cycle.resync_after
        self.leadership.committed(clock, epoch, until, acquired)
        return results, cycle

    def _fence_ahead(self, resync: bool) -> bool:
        """Whether this cycle may decide before it holds the clock row, the lock sent with its closing writes
        (ledger.fence, PostgreSQL): this replica leads, its view is its own as of its last commit, no other writer
        was seen lately, the cycle is not the one that renews the lease or looks for other writers, and the lease
        has half its length left by the database's clock as last read (the server checks it again, exactly)."""
        if not self.settings.fence_in_pipeline or resync or self._initial or self._must_lock:
            return False
        if self._generation is None or not self.leadership.leading or is_sqlite(self.engine):
            return False
        if time.monotonic() < self._fence_off_until:
            return False
        left = self.leadership.until - (time.time() + self._db_clock_offset)
        return left >= self.leadership.lease_s / 2

    def _release_leadership(self) -> None:
        """On a graceful stop, give the lease up so that another replica leads at once (writer thread)."""
        if self.leadership.leading:
            try:
                conn = self._writer_connection()
            except Exception as exc:  # the lease runs out by itself
                log.warning("leadership_release_failed", error=str(exc)[:200])
                return
            self.leadership.release(conn)

    def _close_writer_connection(self) -> None:
        if self._writer_conn is not None:
            with contextlib.suppress(Exception):
                self._writer_conn.close()
            self._writer_conn = None

    def _timers_due(self, now: float) -> bool:
        s = self.settings
        if now >= self.state.wake_at:
            return True
        if any(
            n.state in ("READY", "DRAINED") and now - n.last_heartbeat > s.lease_timeout
            for n in self.state.nodes.values()
        ):
            return True
        return any(
            j.launch_deadline is not None and now > j.launch_deadline
            for j in self.state.jobs.in_state("RUNNING").values()
        )

    def _after_commit(self, cycle: Cycle) -> None:
        for job in cycle.changed.values():
            self.fanout.publish(job, cycle.now)
        for name, revision, message in cycle.work.delivered:
            self.fanout.deliver(name, revision, message)
        if cycle.foreign_writes:
            if cycle.foreign_assigned is None:
                self.fanout.wake_all_nodes()
            else:
                for name in cycle.foreign_assigned:
                    self.fanout.wake_node(name)
        if cycle.metrics.admission_path:
            self.admissions[cycle.metrics.admission_path] += 1
            if cycle.metrics.lane_skipped:
                self.lane_skips[cycle.metrics.lane_skipped] += 1
            metrics.ADMISSIONS.labels(cycle.metrics.admission_path).inc()
        if cycle.metrics.admitted_at_submit:
            self.admissions["admitted_at_submit"] += cycle.metrics.admitted_at_submit
            metrics.ADMITTED_AT_SUBMIT.inc(cycle.metrics.admitted_at_submit)
        for _job, latency in cycle.metrics.reserved:
            metrics.RESERVATIONS.inc()
            metrics.RESERVATION_LATENCY.observe(max(latency, 0.0))
        for victim, _by in cycle.metrics.preempted:
            metrics.JOB_PREEMPTIONS.labels(victim).inc()
        for _claimant, asked in cycle.metrics.claims_run:
            metrics.PREEMPTIONS_PER_ATTEMPT.observe(asked)
        if cycle.finished:
            metrics.forget_jobs(cycle.finished)
        now = time.monotonic()
        if now >= self._next_gauges:  # whole-cluster gauges are O(nodes): refresh them twice a second at most
            self._next_gauges = now + 0.5
            asyncio.get_running_loop().call_soon(self._update_gauges)
        if self.settings.metrics_port and now >= self._next_goodput:  # O(active jobs + sums): every 10 s at most
            self._next_goodput = now + 10.0
            asyncio.ensure_future(self._update_goodput())
        if self.leading and cycle.finished:
            self._account_soon()
        if self.leading and now >= self._next_retention:
            self._next_retention = now + retention.CHECK_INTERVAL_S
            self._account_soon()  # (also what other replicas finished, and what finished before revision 0016)
            if self.settings.retain_finished_s > 0:
                asyncio.ensure_future(self._retention())

    def _account_soon(self, delay: float | None = None) -> None:
        """Account the finished jobs not accounted yet into goodput_totals, ACCOUNT_AFTER_S (or `delay`) from now:
        the leader's upkeep, on a reader thread, in transactions of their own (retention.account_backlog), never in
        the cycle that finished them. The goodput read is exact meanwhile: it computes the jobs not accounted from their
        attempts (accounting._read_totals). Jobs finishing within ACCOUNT_AFTER_S share one transaction."""
        if self._accounting:
            self._account_again = True
        elif self._account_timer is None and not self._stopping:
            loop = asyncio.get_running_loop()
            self._account_timer = loop.call_later(
                retention.ACCOUNT_AFTER_S if delay is None else delay, lambda: asyncio.ensure_future(self._account())
            )

    async def _account(self) -> None:
        self._account_timer = None
        self._accounting, self._account_again = True, False
        batch, batches = retention.BATCH, retention.MAX_BATCHES
        more, failed = False, False
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                self._readers,
                functools.partial(retention.account_backlog, self.engine, batch=batch, max_batches=batches),
            )
            more = done >= batch * batches
        except Exception as exc:  # tried again later; the reads are exact meanwhile
            log.warning("finished_jobs_accounting_failed", error=str(exc)[:200])
            failed = True
        finally:
            self._accounting = False
        if self._stopping:
            return
        if failed:
            self._account_soon(retention.ACCOUNT_RETRY_S)  # (a ledger that refuses: not four warnings a second)
        elif more or self._account_again:
            self._account_soon()

    async def _retention(self) -> None:
        """With --retain-finished, the leader's archive of the finished jobs past it, on a reader thread, in
        transactions of their own (never the cycle's), a batch at a time (retention.py)."""
        before = time.time() - self.settings.retain_finished_s
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._readers, retention.archive_finished, self.engine, before
            )
        except Exception as exc:  # retention must never hurt the scheduler; the next run tries again
            log.warning("finished_jobs_archive_failed", error=str(exc)[:200])

    async def _update_goodput(self) -> None:
        try:
            total, _, _ = await self.read_snapshot(accounting.read_goodput, self.clock(), limit=0)
        except Exception as exc:  # metrics must never hurt the scheduler
            log.warning("goodput_metrics_failed", error=str(exc)[:200])
            return
        for category, value in total.as_dict().items():
            metrics.GOODPUT.labels(category).set(value)
        metrics.GOODPUT_RATIO.set(total.ratio)

    def _update_gauges(self) -> None:
        # (the event loop's thread, beside the writer's: read the indexes as they are, never reorder them)
        jobs = self.state.jobs
        metrics.QUEUE_DEPTH.set(jobs.count("PENDING"))
        metrics.GPUS_FREE.set(self.state.capacity.free_gpus())
        running = jobs.unordered("RUNNING")
        spare = sum(len(g) for j in running for _, _, g in j.spares)  # (held idle: charged, never a rank's)
        metrics.GPUS_ALLOCATED.set(sum(len(g) for j in running for _, _, g in j.allocations) + spare)
        metrics.GPUS_SPARE.set(spare)
        nodes = list(self.state.nodes.values())  # one C call: the writer thread may add a node meanwhile
        pending = jobs.unordered("PENDING")
        metrics.set_scheduler_groups(pending, running, nodes, list(self.state.queues))

    # ---- cross-replica notifications (PostgreSQL) ----------------------------------------------------------------

    def _listen(self) -> None:
        import psycopg

        url = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._stopping:
            try:
                loop = self._loop
                if loop is None:  # started only from start(), once the loop is known
                    raise RuntimeError("the listener runs before the service's event loop is known")
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {ledger.NOTIFY_CHANNEL}")
                    while not self._stopping:
                        for note in conn.notifies(timeout=1.0):
                            loop.call_soon_threadsafe(self._on_remote_change, note.payload)
            except Exception as exc:  # keep listening across outages
                if not self._stopping:
                    log.warning("listen_reconnect", error=str(exc)[:200])
                    time.sleep(1.0)

    def _on_remote_change(self, payload: str) -> None:
        try:
            body = json.loads(payload)
        except ValueError:
            return
        if body.get("replica") == self.settings.replica_id:
            return
        self._fence_off_until = time.monotonic() + self._fence_quiet_s  # (from the event loop: a float, read whole)
        if body.get("here"):
            return  # a follower's lease tick: nothing changed
        # The next cycle sees the generation move and reads what changed from ledger_changes (no full reload);
        # the streams of the nodes named wake now, those of a notice too large to name them after that cycle.
        self._wake.set()
        for name in body.get("nodes", []):
            self.fanout.wake_node(name)
        jobs = body.get("jobs", [])
        if jobs and self.fanout.watched:
            asyncio.ensure_future(self._publish_from_ledger(jobs))

    async def _publish_from_ledger(self, job_ids: list[str]) -> None:
        at = self.clock()  # another replica's commit, just notified
        for job in await self.read_jobs(job_ids=job_ids):
            self.fanout.publish(job, at)

    # ---- reads (consistent snapshots straight from the ledger) ---------------------------------------------------

    async def read(self, fn, *args, **kwargs):
        return await self._read(fn, args, kwargs, snapshot=False)

    async def read_snapshot(self, fn, *args, **kwargs):
        """`read`, with every statement of `fn` reading as of one moment (REPEATABLE READ on PostgreSQL, whose
        default reads each statement as of its own start; a SQLite transaction is one snapshot already)."""
        return await self._read(fn, args, kwargs, snapshot=True)

    async def _read(self, fn, args, kwargs, *, snapshot: bool):
        def run():
            with self.read_engine.connect() as conn:
                options = {"readonly": True}
                if snapshot and conn.dialect.name == "postgresql":
                    options["isolation_level"] = "REPEATABLE READ"
                conn = conn.execution_options(**options)
                with conn.begin():
                    return fn(conn, *args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._readers, run)

    async def read_jobs(self, **filters) -> list[common_pb2.Job]:
        rows = await self.read(ledger.read_jobs, **filters)
        return [job_from_row(j, allocs, parts) for j, allocs, parts in rows]

    async def read_node_events(self, node: str | None = None, limit: int = 100) -> list[Any]:
        return await self.read(ledger.read_node_events, node, limit)

    async def read_nodes(self) -> list[common_pb2.Node]:
        rows, gpus, releasing = await self.read(
            lambda conn: (ledger.read_nodes(conn), ledger.read_node_gpus(conn), ledger.read_releasing(conn))
        )
        return [
            node_from_row(n, used, shared, gpus.get(n["id"], []), releasing.get(n["id"])) for n, used, shared in rows
        ]

    async def assignments_after(self, node: str, after: int) -> list[tuple[int, bytes]]:
        return await self.read(ledger.assignments_after, node, after)


def _db_error(exc: Exception) -> str:
    return str(getattr(exc, "orig", exc) or exc).strip()[:300]


def _merge(a: Cycle | None, b: Cycle) -> Cycle:
    if a is None:
        return b
    a.changed.update(b.changed)
    a.woken_nodes |= b.woken_nodes
    a.metrics.reserved += b.metrics.reserved
    return a


def accept_eligible(state: SchedulerState, sub: Submit) -> bool:
    """Whether a submission waits for a pass whatever happens, so that writing it PENDING and answering at once
    loses it nothing: a PENDING job of its priority or a higher one is ahead of it (the pass serves priority
    first, and the admission lane decides only arrivals strictly ahead of the queue). Job graphs (`after`, arrays)
    and service replicas take the cycle, which checks and builds them. So do MIG requests: their pass may ask a GPU
    to switch its MIG mode for them, and the reply names it; and the switch plan's choice between two waiting MIG
    gangs came out differently for a gang adopted than for one submitted in its cycle (test_mig_manage's reset
    test), which is not understood yet."""
    spec = sub.spec
    if sub.service or spec.after or spec.array or spec.mig_profile:
        return False
    return state.jobs.pending_at_or_above(spec.priority)
