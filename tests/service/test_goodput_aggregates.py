"""Goodput aggregates (issue 18): a finished job's figures enter goodput_totals soon after the commit that finishes
it, in the leader's upkeep (accounting.account_finished, `jobs.accounted`), the total reads only the jobs not
accounted, and the scheduler's accounting, the archive and the reads never count a job twice nor miss one. Every
database test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from alembic import command
from helpers.lite_cluster import LiteCluster
from helpers.procs import eventually
from sqlalchemy import event, func, insert, inspect, select, text, update

from db.engine import make_engine
from db.migrate import alembic_config, upgrade
from db.models import GoodputTotals, Job, JobArchive, JobAttempt
from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.fabric import default_fabric
from phalanx.core.goodput import CATEGORIES, Goodput
from phalanx.testing.lite_agent import LiteAgent
from services.common import metrics
from services.scheduler import accounting, ledger, retention
from services.scheduler.settings import SchedulerSettings

DAY = 86400.0
NOW = float(int(time.time()) - 3600)
BEFORE = NOW - 30 * DAY
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


# ---- helpers -------------------------------------------------------------------------------------------------------


def _jid(n: int) -> str:
    return f"{n:012x}"


def _job(
    conn,
    n: int,
    *,
    state: str = "SUCCEEDED",
    submitted: float,
    finished: float = 0.0,
    attempts: int = 2,
    mig_profile: str = "",
) -> str:
    """A job with `attempts` attempts of 2 x 2 GPUs: each queued 10 s, restarting 5 s, working 100 s; all but the
    last preempted (kept 60 s of their work); the last SUCCEEDED, or still running for an active job."""
    job_id = _jid(n)
    active = state in ("PENDING", "RUNNING")
    conn.execute(
        insert(Job).values(
            id=job_id,
            name=f"job-{n}",
            state=state,
            replicas=2,
            gpus_per_replica=2,
            command=["train"],
            attempt=attempts,
            submitted_at=submitted,
            started_at=submitted + 10 if attempts else 0.0,
            finished_at=0.0 if active else finished,
            tenant=("alice", "bob")[n % 2],
            queue=("q1", "q2", "q3")[n % 3],
            mig_profile=mig_profile,
        )
    )
    t = submitted
    for a in range(1, attempts + 1):
        last = a == attempts
        running = t + 15
        ended = None if (last and active) else running + 100
        conn.execute(
            insert(JobAttempt).values(
                job_id=job_id,
                attempt=a,
                gpus=4.0,
                reserved_at=t + 10,
                running_at=running,
                ended_at=ended,
                outcome="" if ended is None else ("SUCCEEDED" if last else "PREEMPTED"),
                kept_until=None if last else running + 60,
            )
        )
        t = ended or t
    return job_id


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    yield e
    e.dispose()


def _read(engine, now: float = NOW, **kw) -> accounting.GoodputRead:
    with engine.connect().execution_options(readonly=True) as conn, conn.begin():
        return accounting.read_goodput_report(conn, now, **kw)


def _old_way(engine, now: float = NOW) -> tuple[Goodput, int]:
    """The total as it was computed before the aggregates, in one snapshot (_old_way_in)."""
    with engine.connect() as conn:
        conn = _snapshot(conn)
        with conn.begin():
            return _old_way_in(conn, now)


def _close(a: Goodput, b: Goodput) -> None:
    for c in CATEGORIES:
        assert getattr(a, c) == pytest.approx(getattr(b, c), rel=1e-9, abs=1e-9), c


def _same(before: accounting.GoodputRead, after: accounting.GoodputRead) -> None:
    assert after.job_count == before.job_count
    _close(after.total, before.total)
    for name in ("tenants", "queues"):
        b, a = getattr(before, name), getattr(after, name)
        assert set(a) == set(b), name
        for key in b:
            assert a[key][1] == b[key][1]
            _close(a[key][0], b[key][0])


def _listed(got: accounting.GoodputRead) -> list[tuple[str, dict[str, float], int]]:
    return [(j["id"], g.as_dict(), n) for j, g, n in got.listed]


def _same_list(a: accounting.GoodputRead, b: accounting.GoodputRead) -> None:
    assert [x[0] for x in _listed(a)] == [x[0] for x in _listed(b)]
    for (_, ga, na), (_, gb, nb) in zip(_listed(a), _listed(b), strict=True):
        _close(Goodput(**ga), Goodput(**gb))
        assert na == nb


def _totals(engine) -> list[dict]:
    with engine.connect() as conn:
        t = GoodputTotals.__table__
        return [dict(r) for r in conn.execute(select(t).order_by(t.c.tenant, t.c.queue, t.c.day)).mappings()]


def _accounted(engine) -> dict[str, tuple[str, bool]]:
    with engine.connect() as conn:
        return {r.id: (r.state, bool(r.accounted)) for r in conn.execute(select(Job.id, Job.state, Job.accounted))}


# ---- the scheduler accounts what it finishes ------------------------------------------------------------------------


async def _state(c: LiteCluster, job_id: str, state: int):
    job = await c.job(job_id)
    return job if job.state == state else None


def _snapshot(conn):
    if conn.dialect.name == "postgresql":
        return conn.execution_options(isolation_level="REPEATABLE READ")
    return conn.execution_options(readonly=True)


def _old_way_in(conn, now: float) -> tuple[Goodput, int]:
    """The total as it was computed before the aggregates (every job of `jobs` with its attempts, one by one, plus
    every archive row), in the caller's transaction."""
    jobs = conn.execute(select(Job.__table__)).mappings().all()
    attempts = ledger.read_attempts(conn)
    archive = conn.execute(select(JobArchive.__table__)).mappings().all()
    total = Goodput()
    for job in jobs:
        total += accounting.job_goodput(job, attempts.get(job["id"], []), now)
    for row in archive:
        total += Goodput(**{c: row[c] for c in CATEGORIES})
    return total, len(jobs) + len(archive)


class _ReadChecker:
    """A thread that reads, again and again, the total and the job-by-job figures in one snapshot, and keeps every
    snapshot where they differ: whatever the scheduler and its upkeep commit, the total is exact at every moment."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.wrong: list[tuple[int, int, Goodput, Goodput]] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    async def more(self, n: int = 3) -> None:
        """Wait until `n` more snapshots were read and checked."""
        reads = self.reads

        async def done():
            return self.reads >= reads + n or None

        await eventually(done, what=f"{n} more reads")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        engine = make_engine(self.db_url)
        try:
            with engine.connect() as conn:
                conn = _snapshot(conn)
                while not self._stop.is_set():
                    now = time.time()
                    with conn.begin():
                        got = accounting.read_goodput_report(conn, now, limit=0)
                        old, n = _old_way_in(conn, now)
                    self.reads += 1
                    close = all(
                        getattr(got.total, c) == pytest.approx(getattr(old, c), rel=1e-9, abs=1e-6) for c in CATEGORIES
                    )
                    if got.job_count != n or not close:
                        self.wrong.append((got.job_count, n, got.total, old))
                    self._stop.wait(0.005)  # (paces the reads; returns at once when stopped)
        finally:
            engine.dispose()


async def test_the_jobs_the_scheduler_finishes_are_accounted_off_the_cycle_and_read_exactly_meanwhile(
    db_url, engine, monkeypatch, service_logs
):
    """The cycle that finishes a job does not account it (its commit carries no accounting): with the leader's
    upkeep held off, finished jobs stay not accounted, and the total counts them from their attempts, exactly."""
    monkeypatch.setattr(retention, "ACCOUNT_AFTER_S", 3600.0)
    monkeypatch.setattr(retention, "CHECK_INTERVAL_S", 3600.0)
    names = ["node-0"]
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names))
    with _ReadChecker(db_url) as checker:
        async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n) for n in names]) as c:
            ok = await c.submit("ok", gpus=2, command=["sleep", "0.2"])
            bad = await c.submit("bad", gpus=2, command=["exit", "3"])
            await eventually(lambda: _state(c, ok.id, common_pb2.JOB_STATE_SUCCEEDED), what="ok SUCCEEDED")
            await eventually(lambda: _state(c, bad.id, common_pb2.JOB_STATE_FAILED), what="bad FAILED")
            await checker.more()
            assert _accounted(engine) == {ok.id: ("SUCCEEDED", False), bad.id: ("FAILED", False)}
    assert checker.wrong == []
    assert _totals(engine) == []
    got = _read(engine, time.time() + 1000, limit=0)
    old, n = _old_way(engine, time.time() + 1000)
    assert got.job_count == n == 2
    _close(got.total, old)


async def test_the_leader_accounts_the_jobs_its_cycles_finish_soon_after(db_url, service_logs):
    names = ["node-0"]
    settings = SchedulerSettings(
        db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names), retain_finished_s=0.0
    )
    engine = make_engine(db_url)
    try:
        with _ReadChecker(db_url) as checker:
            async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n) for n in names]) as c:
                ok = await c.submit("ok", gpus=2, command=["sleep", "0.3"])
                bad = await c.submit("bad", gpus=2, command=["exit", "3"])  # max_restarts 0: FAILED
                hog = await c.submit("hog", gpus=4)  # runs until cancelled
                await c.wait_running(hog.id)
                await eventually(lambda: _state(c, ok.id, common_pb2.JOB_STATE_SUCCEEDED), what="ok SUCCEEDED")
                await eventually(lambda: _state(c, bad.id, common_pb2.JOB_STATE_FAILED), what="bad FAILED")
                blocked = await c.submit("blocked", gpus=8)  # waits: the hog holds half of the node
                assert (await c.job(blocked.id)).state == common_pb2.JOB_STATE_PENDING

                def accounted(expected):
                    async def check():
                        return (_accounted(engine) == expected) or None

                    return check

                await eventually(
                    accounted(
                        {
                            ok.id: ("SUCCEEDED", True),
                            bad.id: ("FAILED", True),
                            hog.id: ("RUNNING", False),
                            blocked.id: ("PENDING", False),
                        }
                    ),
                    what="the finished jobs accounted",
                )
                await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=blocked.id))  # PENDING: no teardown
                await c.stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=hog.id))  # RUNNING: teardown
                await eventually(lambda: _state(c, hog.id, common_pb2.JOB_STATE_CANCELLED), what="hog CANCELLED")
                await eventually(
                    accounted(
                        {
                            j: (s, True)
                            for j, s in (
                                (ok.id, "SUCCEEDED"),
                                (bad.id, "FAILED"),
                                (hog.id, "CANCELLED"),
                                (blocked.id, "CANCELLED"),
                            )
                        }
                    ),
                    what="every job accounted",
                )
                await checker.more()
        assert checker.wrong == []  # exact before, during and after each accounting
        totals = _totals(engine)
        assert sum(t["jobs"] for t in totals) == 4
        day = accounting.day_of(time.time())
        assert {t["day"] for t in totals} <= {day, day - int(DAY)}  # submitted just now (midnight: either day)
        # every job is finished: the total is the sums alone, equal to the job-by-job figures whenever it is read
        later = time.time() + 1000
        after = _read(engine, later)
        old, n = _old_way(engine, later)
        assert after.job_count == n == 4
        _close(after.total, old)
        # a second accounting of the same jobs is a no-op
        with engine.begin() as conn:
            assert accounting.account_finished(conn, [ok.id, bad.id, hog.id, blocked.id, "nosuchjob"], later) == 0
        assert _totals(engine) == totals
        # the archive moves accounted jobs without adding them again
        assert retention.archive_finished(engine, time.time() + 10, now=later) == 4
        assert _totals(engine) == totals
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Job)).scalar() == 0
        _same(after, _read(engine, later))
    finally:
        engine.dispose()


async def test_a_failed_accounting_run_is_tried_again_later(db_url, engine, monkeypatch, service_logs):
    """The upkeep's run fails (the ledger refuses, say): it is tried again ACCOUNT_RETRY_S later, not at once, and
    the finished job is accounted then."""
    monkeypatch.setattr(retention, "ACCOUNT_AFTER_S", 0.01)
    monkeypatch.setattr(retention, "ACCOUNT_RETRY_S", 0.5)
    real = retention.account_backlog
    calls: list[float] = []

    def failing_once(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("the ledger refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(retention, "account_backlog", failing_once)
    names = ["node-0"]
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(names))
    async with LiteCluster(settings, lambda addr: [LiteAgent(addr, n) for n in names]) as c:
        ok = await c.submit("ok", gpus=2, command=["exit", "0"])
        await eventually(lambda: _state(c, ok.id, common_pb2.JOB_STATE_SUCCEEDED), what="ok SUCCEEDED")

        async def accounted():
            return _accounted(engine).get(ok.id) == ("SUCCEEDED", True) or None

        await eventually(accounted, what="the job accounted after the retry")
    failed_at = calls[0]
    assert len(calls) >= 2 and calls[1] - failed_at >= 0.5, calls  # not tried again at once
    assert "finished_jobs_accounting_failed" in service_logs.text


async def test_the_leader_accounts_the_finished_jobs_it_finds_not_accounted(db_url, engine, monkeypatch, service_logs):
    """Jobs that finished before revision 0016 (or were written by another tool) are not accounted: the leader
    accounts them in the background on start, in batches, until none is left, and the total stays the same."""
    with engine.begin() as conn:
        legacy = [_job(conn, n, submitted=NOW - 5 * DAY + n, finished=NOW - 4 * DAY + n) for n in range(1, 11)]
        running = _job(conn, 11, state="RUNNING", submitted=NOW - DAY)
    expected, n = _old_way(engine)
    assert _read(engine, limit=0).job_count == n == 11
    monkeypatch.setattr(retention, "BATCH", 3)  # 10 jobs: two runs of at most 2 batches of 3
    monkeypatch.setattr(retention, "MAX_BATCHES", 2)
    settings = SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", fabric=default_fabric(["node-0"]))
    async with LiteCluster(settings, lambda addr: [LiteAgent(addr, "node-0")]):

        async def all_accounted():
            states = _accounted(engine)
            return all(states[j][1] for j in legacy) or None

        await eventually(all_accounted, what="the legacy jobs accounted", timeout=20)
        assert not _accounted(engine)[running][1]
    assert sum(t["jobs"] for t in _totals(engine)) == 10
    got = _read(engine, limit=0)
    assert got.job_count == 11
    _close(got.total, expected)


# ---- account_finished --------------------------------------------------------------------------------------------


def test_account_finished_counts_each_finished_job_once_in_a_fixed_number_of_statements(engine):
    with engine.begin() as conn:
        finished = [_job(conn, n, submitted=NOW - 5 * DAY + n, finished=NOW - 4 * DAY + n) for n in range(1, 41)]
        running = _job(conn, 41, state="RUNNING", submitted=NOW - DAY)
        pending = _job(conn, 42, state="PENDING", submitted=NOW - DAY, attempts=0)
    before = _read(engine)
    old, n = _old_way(engine)
    assert before.job_count == n == 42
    _close(before.total, old)
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_):
        statements.append(statement)

    with engine.begin() as conn:
        event.listen(engine, "before_cursor_execute", count)
        try:
            assert accounting.account_finished(conn, [*finished, running, pending, "nosuchjob"], NOW) == 40
        finally:
            event.remove(engine, "before_cursor_execute", count)
    work = [s for s in statements if not s.lstrip().upper().startswith(("BEGIN", "SAVEPOINT", "RELEASE"))]
    # the guarded flag returning the jobs, their attempts (on PostgreSQL in the same statement: the flag's UPDATE in
    # a CTE joined with them), one multi-row upsert (2 tenants x 3 queues x 1-2 days)
    assert len(work) == (2 if engine.dialect.name == "postgresql" else 3), work
    assert sum(t["jobs"] for t in _totals(engine)) == 40
    state = _accounted(engine)
    assert all(state[j] == ("SUCCEEDED", True) for j in finished)
    assert state[running] == ("RUNNING", False) and state[pending] == ("PENDING", False)
    after = _read(engine)
    _same(before, after)
    _close(after.total, _old_way(engine)[0])
    totals = _totals(engine)
    with engine.begin() as conn:  # again: a no-op
        assert accounting.account_finished(conn, finished, NOW) == 0
    assert _totals(engine) == totals
    # a job is accounted as of its end, whatever `now` the caller passes: the archive's figures are the same
    with engine.connect() as conn:
        rows, attempts = retention.load_jobs(conn, finished[:1])
    g_late = accounting.job_goodput(rows[0], attempts[finished[0]], NOW + 50 * DAY)
    _close(g_late, _read(engine, job_ids=finished[:1]).total)


def test_the_total_reads_only_the_jobs_not_accounted(engine, monkeypatch):
    with engine.begin() as conn:
        finished = [_job(conn, n, submitted=NOW - 5 * DAY + n, finished=NOW - 4 * DAY + n) for n in range(1, 31)]
        active = [_job(conn, 31, state="RUNNING", submitted=NOW - DAY), _job(conn, 32, state="RUNNING", submitted=NOW)]
        active.append(_job(conn, 33, state="PENDING", submitted=NOW, attempts=0))
        _job(conn, 34, submitted=NOW - 5 * DAY, finished=NOW - 4 * DAY)  # finished, not accounted yet
        # preempted once and queued again: its figures are its attempt's and its waiting since (a job ever reserved)
        requeued = _job(conn, 35, state="PENDING", submitted=NOW - DAY, attempts=1)
        conn.execute(
            update(JobAttempt)
            .where(JobAttempt.job_id == requeued)
            .values(ended_at=NOW - DAY + 125, outcome="PREEMPTED", kept_until=NOW - DAY + 85)
        )
        mig = _job(conn, 36, state="RUNNING", submitted=NOW - DAY, mig_profile="3g.40gb")  # a fraction of a GPU
        accounting.account_finished(conn, finished, NOW)
    expected, n = _old_way(engine)
    statements: list[tuple[str, object]] = []
    computed: list[str] = []
    job_goodput = accounting.job_goodput

    def spy(job, attempts, now):
        computed.append(job["id"])
        return job_goodput(job, attempts, now)

    def record(_conn, _cursor, statement, parameters, *_):
        statements.append((statement, parameters))

    monkeypatch.setattr(accounting, "job_goodput", spy)
    event.listen(engine, "before_cursor_execute", record)
    try:
        got = _read(engine, limit=0)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert got.job_count == n == 36
    _close(got.total, expected)
    # no finished job accounted is computed, and only the MIG gang in Python (the others' figures are computed in
    # SQL: test_goodput_sql.py) ...
    assert computed == [mig]
    reads_jobs = [(s, p) for s, p in statements if re.search(r"\b(FROM|JOIN) jobs\b", s)]
    assert reads_jobs
    for statement, _ in reads_jobs:  # ... nor read: every read of `jobs` is of the jobs not accounted
        assert re.search(r"jobs\.accounted = (false|0)\b", statement), statement
    # and it goes through the partial index, whatever the number of finished jobs (seqscan off: the plan the
    # index would serve, not the one a 34-row table gets)
    # (on PostgreSQL from the index alone, revision 0025: an index-only scan never visits the finished jobs' rows)
    for statement, params in reads_jobs:
        with engine.connect() as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
                conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
                explain = "EXPLAIN"
            else:
                explain = "EXPLAIN QUERY PLAN"
            lines = [" ".join(map(str, r)) for r in conn.exec_driver_sql(f"{explain} {statement}", params).all()]
            plan = "\n".join(lines)
            # every scan of `jobs` in the statement (the total's is a UNION ALL of several) is of the index
            scans = [x for x in lines if re.search(r"\b(on|SCAN|SEARCH) jobs\b", x)]
            assert scans, plan
            for scan in scans:
                if conn.dialect.name == "postgresql":
                    assert "Index Only Scan using ix_jobs_unaccounted_submitted_at" in scan, plan
                else:
                    assert "USING INDEX ix_jobs_unaccounted_submitted_at" in scan, plan


# ---- reads racing the writers -------------------------------------------------------------------------------------


def _seed_race(engine) -> dict[str, str]:
    with engine.begin() as conn:
        ids = {
            "legacy1": _job(conn, 1, submitted=NOW - 50 * DAY, finished=NOW - 40 * DAY),  # not accounted, due
            "legacy2": _job(conn, 2, submitted=NOW - 50 * DAY + 7, finished=NOW - 40 * DAY),
            "accounted": _job(conn, 3, submitted=NOW - 50 * DAY + 9, finished=NOW - 40 * DAY),  # due
            "archived": _job(conn, 4, submitted=NOW - 60 * DAY, finished=NOW - 55 * DAY),
            "running": _job(conn, 5, state="RUNNING", submitted=NOW - 2 * DAY),
            "pending": _job(conn, 6, state="PENDING", submitted=NOW - DAY, attempts=0),
            "mig": _job(conn, 7, state="RUNNING", submitted=NOW - DAY, mig_profile="1g.10gb"),  # figured in Python
        }
        accounting.account_finished(conn, [ids["accounted"]], NOW)
        jobs, attempts = retention.load_jobs(conn, [ids["archived"]])
        retention.archive_jobs(conn, jobs, attempts, NOW)
    return ids


def _finish_running(conn, job_id: str) -> None:
    """What a cycle does when the running job succeeds at NOW: its state, its attempt's end, its accounting."""
    conn.execute(update(Job).where(Job.id == job_id).values(state="SUCCEEDED", finished_at=NOW))
    conn.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job_id, JobAttempt.ended_at.is_(None))
        .values(ended_at=NOW, outcome="SUCCEEDED")
    )
    assert accounting.account_finished(conn, [job_id], NOW) == 1


ACTIONS = {
    "account": lambda writer, ids: _in_tx(
        writer, lambda c: accounting.account_finished(c, [ids["legacy1"], ids["legacy2"]], NOW)
    ),
    "archive": lambda writer, ids: retention.archive_finished(writer, BEFORE, now=NOW),
    "backlog_then_archive": lambda writer, ids: (
        retention.account_backlog(writer, now=NOW),
        retention.archive_finished(writer, BEFORE, now=NOW),
    ),
    "finish": lambda writer, ids: _in_tx(writer, lambda c: _finish_running(c, ids["running"])),
    "finish_mig": lambda writer, ids: _in_tx(writer, lambda c: _finish_running(c, ids["mig"])),
}


def _in_tx(engine, fn):
    with engine.begin() as conn:
        return fn(conn)


@pytest.mark.parametrize("action", sorted(ACTIONS))
@pytest.mark.parametrize("after_select", [1, 2, 3, 4, 5, 6])
def test_a_job_accounted_or_archived_during_a_read_counts_once(engine, db_url, action, after_select):
    """PostgreSQL reads each statement as of its own start: another transaction's accounting or archive may commit
    between a read's statements. Staged here by committing it, on another connection, right after the read's
    `after_select`-th SELECT (1: the MIG gangs not accounted, 2: their attempts, 3: the sums with every other job's
    figures, 4: the newest jobs, 5: their attempts, 6: the archive's newest). SQLite reads the whole transaction as
    of its first statement."""
    ids = _seed_race(engine)
    before = _read(engine, limit=10)
    old, n = _old_way(engine)
    assert before.job_count == n == 7
    _close(before.total, old)
    writer = make_engine(db_url)
    selects = 0

    def interleave(_conn, _cursor, statement, *_):
        nonlocal selects
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            selects += 1
            if selects == after_select:
                ACTIONS[action](writer, ids)

    try:
        event.listen(engine, "after_cursor_execute", interleave)
        try:
            during = _read(engine, limit=10)
        finally:
            event.remove(engine, "after_cursor_execute", interleave)
        assert selects >= after_select  # the writer did commit inside the read
        _same(before, during)  # the figures of a finished job do not change when it is accounted or archived
        _same_list(before, during)
        after = _read(engine, limit=10)
        _same(before, after)
        _same_list(before, after)
        with writer.connect() as conn:
            assert (
                conn.execute(select(func.sum(GoodputTotals.jobs))).scalar()
                == {
                    "account": 4,
                    "archive": 4,
                    "backlog_then_archive": 4,
                    "finish": 3,
                    "finish_mig": 3,
                }[action]
            )
    finally:
        writer.dispose()


def test_archivers_and_backlog_passes_racing_count_each_job_once(engine):
    with engine.begin() as conn:
        for n in range(1, 61):
            _job(conn, n, submitted=NOW - 50 * DAY + n, finished=NOW - 40 * DAY + n)
        _job(conn, 61, state="RUNNING", submitted=NOW - DAY)
        accounting.account_finished(conn, [_jid(n) for n in range(1, 61, 4)], NOW)  # some accounted already
    before = _read(engine)
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [
        lambda: retention.archive_finished(engine, BEFORE, now=NOW, batch=5, max_batches=100),
        lambda: retention.account_backlog(engine, now=NOW, batch=4, max_batches=None),
    ] * 2
    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    retention.archive_finished(engine, BEFORE, now=NOW, batch=5, max_batches=100)  # whatever a conflict left
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(JobArchive)).scalar() == 60
        assert conn.execute(select(func.sum(GoodputTotals.jobs))).scalar() == 60
    _same(before, _read(engine))


# ---- jobs from before the column: the backlog pass, the migration -------------------------------------------------


def test_account_backlog_and_its_command_account_the_jobs_finished_before_the_column(
    engine, db_url, capsys, service_logs
):
    with engine.begin() as conn:
        legacy = [_job(conn, n, submitted=NOW - 5 * DAY + n, finished=NOW - 4 * DAY) for n in range(1, 8)]
        running = _job(conn, 8, state="RUNNING", submitted=NOW - DAY)
    before = _read(engine)
    assert retention.account_backlog(engine, now=NOW, batch=3, max_batches=1) == 3
    assert retention.main(["account", "--db", db_url]) == 0
    assert json.loads(capsys.readouterr().out) == {"accounted": 4}
    state = _accounted(engine)
    assert all(state[j][1] for j in legacy) and state[running] == ("RUNNING", False)
    _same(before, _read(engine))
    assert retention.main(["account", "--db", db_url]) == 0
    assert json.loads(capsys.readouterr().out) == {"accounted": 0}
    assert retention.account_backlog(engine) == 0


def test_revision_0016_adds_the_column_unaccounted_and_goes_back_down(empty_db_url):
    upgrade(empty_db_url, "0015")
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            for job_id, state, finished in (("old-finished", "SUCCEEDED", NOW - DAY), ("old-running", "RUNNING", 0)):
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, name, state, priority, replicas, gpus_per_replica, procs_per_replica,"
                        " command, env, attempt, message, exit_code, placement, submitted_at, started_at,"
                        " finished_at, version) VALUES (:id, :id, :state, 0, 1, 1, 0, '[]', '{}', 0, '', 0, '{}',"
                        " :submitted, 0, :finished, 0)"
                    ),
                    dict(id=job_id, state=state, submitted=NOW - 2 * DAY, finished=finished),
                )
        upgrade(empty_db_url)
        assert _accounted(engine) == {"old-finished": ("SUCCEEDED", False), "old-running": ("RUNNING", False)}
        got = _read(engine)
        assert got.job_count == 2  # read from `jobs` until accounted
        assert retention.account_backlog(engine, now=NOW) == 1
        _same(got, _read(engine))
        command.downgrade(alembic_config(empty_db_url), "0015")
        with engine.connect() as conn:
            assert "accounted" not in {c["name"] for c in _columns(conn, "jobs")}
            assert conn.execute(text("SELECT count(*) FROM jobs")).scalar() == 2
        upgrade(empty_db_url)
        assert _accounted(engine)["old-finished"] == ("SUCCEEDED", False)
    finally:
        engine.dispose()


def _columns(conn, table: str):
    return inspect(conn).get_columns(table)


# ---- the metrics -----------------------------------------------------------------------------------------------------


async def test_the_goodput_metrics_read_the_same_aggregates(engine, db_url, monkeypatch, service_logs):
    from services.scheduler.main import serve

    with engine.begin() as conn:
        finished = [_job(conn, n, submitted=NOW - 5 * DAY + n, finished=NOW - 4 * DAY) for n in range(1, 6)]
        _job(conn, 6, state="RUNNING", submitted=NOW - DAY)
        accounting.account_finished(conn, finished, NOW)
    calls: list[dict] = []
    report = accounting.read_goodput_report

    def spy(conn, now, **kw):
        calls.append(kw)
        return report(conn, now, **kw)

    monkeypatch.setattr(accounting, "read_goodput_report", spy)
    running = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", retain_finished_s=0.0))
    try:
        await running.service._update_goodput()
    finally:
        await running.stop()
    assert calls and calls[-1]["limit"] == 0 and calls[-1]["job_ids"] is None and calls[-1]["since"] == 0.0
    shown = {c: metrics.GOODPUT.labels(c)._value.get() for c in CATEGORIES}
    now = time.time()
    expected = _read(engine, now).total
    for c in CATEGORIES:  # the running job's figures grew a little since the metrics read
        assert shown[c] == pytest.approx(getattr(expected, c), rel=1e-3), c
    assert shown["allocated"] > 0
