"""Goodput from the ledger: job_attempts rows through phalanx.core.goodput, per job and for the cluster.

The cluster's total is kept incrementally: a job's figures enter goodput_totals (by tenant, queue and UTC day of
submission) soon after it finished, in a transaction of the leader's upkeep, never the scheduling cycle's
(account_finished through retention.account_backlog; jobs.accounted marks it), or when retention archives it. The
total is then those sums plus the live figures of the jobs not accounted (the active ones, and those finished in
the last moments), computed in SQL from their attempts (_sql_figures; MIG gangs in Python): no read loads the
finished jobs, and none costs Python per job. The listed jobs are exact per job, from `jobs` (their attempts) or
job_archive."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Connection,
    Float,
    String,
    Table,
    and_,
    bindparam,
    case,
    false,
    func,
    literal,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import GOODPUT_JOB_COLUMNS, TERMINAL_JOB_STATES, GoodputTotals, Job, JobArchive, JobAttempt
from phalanx.api.v1 import common_pb2, scheduler_pb2
from phalanx.core.goodput import CATEGORIES, AttemptTimes, Goodput, account_job, total

from . import ledger, paging
from .state import gpu_equivalents


def attempt_times(rows: Sequence[Any]) -> list[AttemptTimes]:
    return [
        AttemptTimes(
            attempt=r["attempt"],
            gpus=r["gpus"],
            reserved_at=r["reserved_at"],
            running_at=r["running_at"],
            ended_at=r["ended_at"],
            outcome=r["outcome"] or "",
            kept_until=r["kept_until"],
        )
        for r in rows
    ]


def job_goodput(job: Any, attempts: Sequence[Any], now: float) -> Goodput:
    """`job`: a jobs row (mapping); `attempts`: its job_attempts rows in order. A finished job is accounted as of its
    end (`now` no later than its finished_at): its figures do not change after it finished, so the archive keeps
    exactly what the live ledger showed (retention.py)."""
    gpus = gpu_equivalents(job["replicas"], job["gpus_per_replica"], job["mig_profile"] or "", job["gpu_milli"] or 0)
    finished = job["finished_at"] if job["state"] in TERMINAL_JOB_STATES else None
    if finished:
        now = min(now, finished)
    return account_job(job["submitted_at"], gpus, attempt_times(attempts), now, finished_at=finished)


DAY_S = 86400


def day_of(t: float) -> int:
    """The start (unix seconds) of the UTC day holding `t`: the bucket of goodput_totals an accounted job counts in
    (its submission's day). Times beyond any day a job can have (an infinite `since`) map past every bucket."""
    if not t < 1e15:  # also inf and nan; kept within a BIGINT
        return 1 << 62
    if t < -1e15:  # before every bucket
        return -(1 << 62)
    return int(math.floor(t / DAY_S)) * DAY_S


# ---- the aggregates: finished jobs into goodput_totals ---------------------------------------------------------------


def _unaccounted(table: Any) -> Any:
    """`accounted = false`, rendered as the partial index ix_jobs_unaccounted_submitted_at's predicate matches it
    (a literal, not a bound parameter: SQLite's planner uses the index only so)."""
    return table.c.accounted == false()


def add_totals(conn: Connection, rows: Iterable[Mapping[str, Any]], now: float) -> None:
    """Add figures and a count of one per row (mappings with tenant, queue, submitted_at and the goodput
    categories) into goodput_totals, by (tenant, queue, UTC day of submission): one upsert statement, executed for
    every (tenant, queue, day) at once."""
    groups: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        key = (r["tenant"] or "", r["queue"] or "default", day_of(r["submitted_at"]))
        acc = groups.setdefault(key, [0.0] * (len(CATEGORIES) + 1))
        acc[0] += 1
        for i, c in enumerate(CATEGORIES, start=1):
            acc[i] += r[c]
    if not groups:
        return
    values = [  # sorted: two writers lock the rows in one order
        dict(tenant=tenant, queue=queue, day=day, jobs=int(acc[0]), updated_at=now, **dict(zip(CATEGORIES, acc[1:])))
        for (tenant, queue, day), acc in sorted(groups.items())
    ]
    conn.execute(_totals_upsert(conn.dialect.name), values)


_UPSERTS: dict[str, Any] = {}


def _totals_upsert(dialect: str) -> Any:
    """The goodput_totals upsert of one row, built once per dialect: a cycle sends its rows through executemany
    with the compiled statement cached, not a multi-row statement compiled anew for every row count."""
    stmt = _UPSERTS.get(dialect)
    if stmt is None:
        table = cast(Table, GoodputTotals.__table__)
        ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(table)
        added = {c: table.c[c] + ins.excluded[c] for c in ("jobs", *CATEGORIES)}
        stmt = _UPSERTS[dialect] = ins.on_conflict_do_update(
            index_elements=["tenant", "queue", "day"], set_={**added, "updated_at": ins.excluded.updated_at}
        )
    return stmt


def mark_accounted(conn: Connection, job_ids: Sequence[str]) -> set[str]:
    """Set `accounted` on those of the finished jobs `job_ids` still in `jobs` and not accounted yet; returns their
    ids: the jobs whose figures the caller (and no other writer) must add to goodput_totals in this transaction.

    The guard makes every writer count a job at most once: a job is accounted by whichever transaction flips its flag
    (PostgreSQL: the UPDATE waits for a transaction that locked the row, then re-checks the row as committed: flagged
    or deleted by it, the job is not returned), and rolled back whole with it."""
    if not job_ids:
        return set()
    jobs = cast(Table, Job.__table__)
    stmt = (
        update(jobs)
        .where(jobs.c.id.in_(list(job_ids)), _unaccounted(jobs), jobs.c.state.in_(TERMINAL_JOB_STATES))
        .values(accounted=True)
        .returning(jobs.c.id)
    )
    return set(conn.execute(stmt).scalars())


def account_finished(conn: Connection, job_ids: Iterable[str], now: float) -> int:
    """Add the goodput of the jobs among `job_ids` that are finished (SUCCEEDED, FAILED, CANCELLED) and not accounted
    into goodput_totals, and mark them accounted, inside the caller's transaction (the leader's upkeep:
    retention.account_backlog, soon after the cycles that finished them). Others (active, accounted, archived,
    unknown) are left alone, so a second call is a no-op.

    A constant number of statements however many jobs: the guarded UPDATE that marks them and returns their rows
    (the jobs whose flag this transaction flipped, and no other writer's) with their attempts (one statement on
    PostgreSQL, two elsewhere), and the upsert (add_totals). Each job's figures are job_goodput's as of its end,
    exactly what the archive would record for it. Returns how many jobs it accounted."""
    ids = sorted(set(job_ids))
    if not ids:
        return 0
    rows, attempts = _mark_accounted_with_attempts(conn, ids)
    if not rows:
        return 0
    figures = [{**r, **job_goodput(r, attempts.get(r["id"], []), now).as_dict()} for r in rows]
    add_totals(conn, figures, now)
    return len(rows)


def _mark_accounted_with_attempts(conn: Connection, ids: list[str]) -> tuple[list[Any], dict[str, list[Any]]]:
    """Set `accounted` on the finished jobs among `ids` not accounted yet (the guard: see mark_accounted) and read
    what their figures need: (their rows, their attempts by job in attempt order). On PostgreSQL one statement (the
    guarded UPDATE in a CTE, joined with the attempts: it sees this transaction's earlier writes, the attempt the
    cycle just ended included), so a cycle that finishes jobs waits for one answer, not two; elsewhere two."""
    jobs = cast(Table, Job.__table__)
    mark = (
        update(jobs)
        .where(jobs.c.id.in_(ids), _unaccounted(jobs), jobs.c.state.in_(TERMINAL_JOB_STATES))
        .values(accounted=True)
        .returning(*(jobs.c[c] for c in _LIVE_COLUMNS))
    )
    if conn.dialect.name != "postgresql":
        rows = conn.execute(mark).mappings().all()
        return list(rows), (_attempts_of(conn, [r["id"] for r in rows]) if rows else {})
    marked = mark.cte("marked")
    att = JobAttempt.__table__
    wanted = [att.c[c].label(f"a_{c}") for c in _ATTEMPT_COLUMNS if c != "job_id"]
    stmt = (
        select(*marked.c, *wanted)
        .select_from(marked.outerjoin(att, att.c.job_id == marked.c.id))
        .order_by(marked.c.id, att.c.attempt)
    )
    found: dict[str, Any] = {}
    attempts: dict[str, list[Any]] = {}
    for row in conn.execute(stmt).mappings().all():
        job_id = row["id"]
        if job_id not in found:
            found[job_id] = {c: row[c] for c in _LIVE_COLUMNS}
        if row["a_attempt"] is not None:
            attempts.setdefault(job_id, []).append(
                {"job_id": job_id, **{c: row[f"a_{c}"] for c in _ATTEMPT_COLUMNS if c != "job_id"}}
            )
    return list(found.values()), attempts


@dataclass
class GoodputRead:
    """What read_goodput_report found. `listed`: (a mapping with id, name, state, preempted_by, submitted_at; its
    goodput; its attempt count), newest first; `after`: the (submitted_at, id) key of the last listed job when more
    follow, else None. `tenants` / `queues`: name -> (goodput, job count), over the same jobs as `total`."""

    total: Goodput = field(default_factory=Goodput)
    job_count: int = 0
    listed: list[tuple[Any, Goodput, int]] = field(default_factory=list)
    after: tuple[float, str] | None = None
    tenants: dict[str, tuple[Goodput, int]] = field(default_factory=dict)
    queues: dict[str, tuple[Goodput, int]] = field(default_factory=dict)

    def add(self, tenant: str, queue: str, g: Goodput, jobs: int) -> None:
        self.total += g
        self.job_count += jobs
        for groups, name in ((self.tenants, tenant), (self.queues, queue)):
            have, n = groups.get(name, (Goodput(), 0))
            groups[name] = (have + g, n + jobs)


_LIVE_COLUMNS = GOODPUT_JOB_COLUMNS  # (revision 0025's index carries them, on PostgreSQL)


def _job_filter(table: Any, since: float, tenant: str | None, job_ids: Sequence[str] | None) -> list[Any]:
    where = [table.c.submitted_at >= since]
    if tenant is not None:
        where.append(table.c.tenant == tenant)
    if job_ids is not None:
        where.append(table.c.id.in_(list(job_ids)))
    return where


def _older_than(table: Any, after: tuple[float, str] | None) -> list[Any]:
    if after is None:
        return []
    at, job_id = after
    return [or_(table.c.submitted_at < at, and_(table.c.submitted_at == at, table.c.id < job_id))]


def _live_attempts(conn: Connection, where: list[Any]) -> dict[str, list[Any]]:
    """job_attempts rows by job, in attempt order, of the jobs in `jobs` matching `where`."""
    jobs = Job.__table__
    stmt = (
        select(*JobAttempt.__table__.c)
        .join(jobs, jobs.c.id == JobAttempt.job_id)
        .where(*where)
        .order_by(JobAttempt.job_id, JobAttempt.attempt)
    )
    out: dict[str, list[Any]] = {}
    for row in conn.execute(stmt).mappings():
        out.setdefault(row["job_id"], []).append(row)
    return out


# What job_goodput reads of an attempt (attempt_times)
_ATTEMPT_COLUMNS = ("job_id", "attempt", "gpus", "reserved_at", "running_at", "ended_at", "outcome", "kept_until")


def _attempts_of(conn: Connection, job_ids: list[str]) -> dict[str, list[Any]]:
    """What job_goodput reads of the attempts of `job_ids`, by job in attempt order, each job's through the primary
    key. On PostgreSQL the ids are joined as an array (unnest): against `job_id = ANY(...)` of ~1,000 ids the planner
    chose to scan the whole table, history included (bench/goodput_read.py). On SQLite in chunks that keep a
    statement's bound parameters within what it takes."""
    att = JobAttempt.__table__
    columns = [att.c[c] for c in _ATTEMPT_COLUMNS]
    order = (att.c.job_id, att.c.attempt)
    if conn.dialect.name == "postgresql":
        wanted = func.unnest(bindparam("job_ids", job_ids, type_=ARRAY(String))).table_valued("id")
        wanted = wanted.render_derived(name="wanted")
        stmts = (
            [select(*columns).join_from(att, wanted, att.c.job_id == wanted.c.id).order_by(*order)] if job_ids else []
        )
    else:
        stmts = [
            select(*columns).where(att.c.job_id.in_(job_ids[start : start + 5000])).order_by(*order)
            for start in range(0, len(job_ids), 5000)
        ]
    grouped: dict[str, list[Any]] = {}
    for stmt in stmts:
        for row in conn.execute(stmt).mappings().all():  # fetched at once: row by row costs a driver call each
            grouped.setdefault(row["job_id"], []).append(row)
    return grouped


def _archived_goodput(row: Any) -> Goodput:
    return Goodput(
        allocated=row["allocated"],
        productive=row["productive"],
        rollback=row["rollback"],
        restart=row["restart"],
        waiting=row["waiting"],
    )


def _busy(jobs: Any) -> Any:
    """The jobs not accounted whose figures need their attempts: those ever reserved (`attempt` > 0: the job_attempts
    row of each reservation is written in the transaction that raises it) and those finished (a job finished is
    accounted by the leader's upkeep soon after, or was finished before revision 0016). The others (queued, never
    reserved) only wait. A column of the row, not a probe of job_attempts per job: at 10,000 queued jobs the probe
    was most of the read (bench/goodput_read.py)."""
    return or_(jobs.c.attempt > 0, jobs.c.state.in_(TERMINAL_JOB_STATES))


def _figured_in_python(jobs: Any) -> Any:
    """The jobs not accounted whose figures job_goodput computes in Python: MIG gangs (their GPU fraction is their
    profile's, gpu_equivalents: a table SQL does not have). Every other job's figures are computed in SQL
    (_sql_figures), so a read costs no Python per job, busy or queued."""
    return func.coalesce(jobs.c.mig_profile, "") != ""


def _greatest(dialect: str, *args: Any) -> Any:
    return (func.greatest if dialect == "postgresql" else func.max)(*args)  # (no argument is ever NULL here)


def _least(dialect: str, *args: Any) -> Any:
    return (func.least if dialect == "postgresql" else func.min)(*args)


def _job_gpus(jobs: Any) -> Any:
    """gpu_equivalents of a job that is not a MIG gang, in SQL."""
    return case(
        (func.coalesce(jobs.c.gpu_milli, 0) > 0, jobs.c.replicas * jobs.c.gpu_milli / literal(1000.0)),
        else_=jobs.c.replicas * jobs.c.gpus_per_replica * literal(1.0),
    )


def _at(now: Any) -> Any:
    """`now` as an SQL value: a number as a literal, an expression (a named bindparam) as it is."""
    return literal(float(now)) if isinstance(now, (int, float)) else now


def _sql_figures(dialect: str, now: Any, where: list[Any], by: Sequence[str]) -> Any:
    """The goodput of the jobs not accounted matching `where` (none a MIG gang), computed in SQL exactly as
    job_goodput computes it in Python (account_job and account_attempt, term by term; only the order of the final
    additions differs), summed
    by the `jobs` columns `by` (tenant and queue for the total; id for one row per job, which the tests compare with
    job_goodput). Columns: *by, jobs (how many), and the categories.

    Each job is joined with its attempts (a job with none gives one row of NULLs, which only waits); on PostgreSQL
    through LATERAL, so each job's attempts are read by primary key whatever the history (a join the planner may turn
    into a scan of every attempt ever). Window functions give each attempt its predecessor's end (from which it
    waited), whether an earlier attempt is still open (account_job stops at the first open attempt) and whether it is
    the last (the job waits from its end until now, or until it finished)."""
    jobs = Job.__table__
    att = JobAttempt.__table__
    g, lo = functools.partial(_greatest, dialect), functools.partial(_least, dialect)
    terminal = jobs.c.state.in_(TERMINAL_JOB_STATES)
    at_now = _at(now)
    finished = func.coalesce(jobs.c.finished_at, 0.0)
    # job_goodput: a finished job is accounted as of its end (when it has one) ...
    job_now = case((and_(terminal, finished != 0.0), lo(at_now, finished)), else_=at_now)
    # ... and waits, after its last attempt, until it finished (else until now)
    job_end = case((and_(terminal, jobs.c.finished_at.is_not(None)), jobs.c.finished_at), else_=at_now)
    wanted = select(
        *(jobs.c[c] for c in by if c != "id"),
        jobs.c.id,
        jobs.c.submitted_at,
        _job_gpus(jobs).label("jg"),
        job_now.label("job_now"),
        job_end.label("job_end"),
    ).where(_unaccounted(jobs), *where)
    # SQLite: the jobs first, through the partial index (its planner, without statistics, would scan every job by
    # primary key to get the windows' order by id)
    j = wanted.cte("unaccounted").prefix_with("MATERIALIZED") if dialect == "sqlite" else wanted.subquery("j")
    columns = [att.c[c] for c in ("attempt", "gpus", "reserved_at", "running_at", "ended_at", "outcome", "kept_until")]
    if dialect == "postgresql":
        attempts: Any = select(*columns).where(att.c.job_id == j.c.id).lateral("a")
        joined = j.outerjoin(attempts, true())
    else:
        attempts = att
        joined = j.outerjoin(att, att.c.job_id == j.c.id)
    a = attempts.c
    window = {"partition_by": j.c.id, "order_by": a.attempt}
    open_before = func.sum(case((and_(a.attempt.is_not(None), a.ended_at.is_(None)), 1), else_=0)).over(
        **window, rows=(None, -1)
    )
    rows = (
        select(
            *(j.c[c] for c in by),
            j.c.id.label("job"),
            j.c.submitted_at,
            j.c.jg,
            j.c.job_now,
            j.c.job_end,
            *(a[c.name] for c in columns),
            func.lag(a.ended_at).over(**window).label("prev_end"),
            func.lag(a.attempt).over(**window).label("prev"),
            func.coalesce(open_before, 0).label("open_before"),
            func.lead(a.attempt).over(**window).label("next"),
        )
        .select_from(joined)
        .subquery("r")
    )
    r = rows.c
    end = g(r.reserved_at, func.coalesce(r.ended_at, r.job_now))
    ready = case((r.running_at.is_(None), end), else_=lo(g(r.running_at, r.reserved_at), end))
    timed = select(rows, end.label("end_t"), ready.label("ready")).subquery("t")
    t = timed.c
    work = t.end_t - t.ready
    kept = case(
        (or_(t.ended_at.is_(None), t.outcome == "SUCCEEDED"), work),
        (t.kept_until.is_(None), literal(0.0)),
        else_=lo(g(t.kept_until - t.ready, literal(0.0)), work),
    )
    since = case((t.prev.is_(None), t.submitted_at), else_=t.prev_end)
    has = t.attempt.is_not(None)
    waited = case((has, t.jg * g(literal(0.0), t.reserved_at - since)), else_=literal(0.0))
    tail = case(
        (
            and_(t.next.is_(None), or_(~has, t.ended_at.is_not(None))),
            t.jg * g(literal(0.0), t.job_end - func.coalesce(t.ended_at, t.submitted_at)),
        ),
        else_=literal(0.0),
    )
    figures = {
        "allocated": t.gpus * (t.end_t - t.reserved_at),
        "productive": t.gpus * kept,
        "rollback": t.gpus * (work - kept),
        "restart": t.gpus * (t.ready - t.reserved_at),
        "waiting": waited + tail,
    }
    return (
        select(
            *(t[c] for c in by),
            func.count(func.distinct(t.job)).label("jobs"),
            *(func.coalesce(func.sum(figures[c]), 0.0).label(c) for c in CATEGORIES),
        )
        .where(t.open_before == 0)
        .group_by(*(t[c] for c in by))
    )


def _idle_waiting(now: Any, where: list[Any]) -> Any:
    """The jobs matching `where` that only wait (queued, never reserved, not MIG gangs): each has waited its GPUs x
    (now - submitted_at), summed per tenant and queue, with no join."""
    jobs = Job.__table__
    at_now = _at(now)
    waited = case((jobs.c.submitted_at < at_now, at_now - jobs.c.submitted_at), else_=literal(0.0))
    return (
        select(
            jobs.c.tenant,
            jobs.c.queue,
            func.count().label("jobs"),
            *(literal(0.0).label(c) for c in CATEGORIES if c != "waiting"),
            func.coalesce(func.sum(_job_gpus(jobs) * waited), 0.0).label("waiting"),
        )
        .where(*where)
        .group_by(jobs.c.tenant, jobs.c.queue)
    )


@functools.cache
def _totals_statements(dialect: str, tenant_scoped: bool) -> tuple[Any, Any]:
    """_read_totals' statements (1) and (3), built once per dialect and tenant scope (building the expression of (3)
    costs more than the database spends on it), with the named parameters now, since, first_day, tenant and mig
    (whether (1) found MIG gangs: (3) then lists those still not accounted). Tests that replace _figured_in_python
    clear the cache."""
    jobs, t = Job.__table__, GoodputTotals.__table__
    now = bindparam("now", type_=Float)
    live_where = [_unaccounted(jobs), jobs.c.submitted_at >= bindparam("since", type_=Float)]
    if tenant_scoped:
        live_where.append(jobs.c.tenant == bindparam("tenant", type_=String))
    in_python = [*live_where, _figured_in_python(jobs)]
    in_sql = [*live_where, ~_figured_in_python(jobs)]
    sums = (
        select(
            literal("sum").label("kind"),
            t.c.tenant,
            t.c.queue,
            literal("").label("id"),
            func.sum(t.c.jobs).label("jobs"),
            *(func.sum(t.c[c]).label(c) for c in CATEGORIES),
        )
        .where(t.c.day >= bindparam("first_day", type_=BigInteger))
        .group_by(t.c.tenant, t.c.queue)
    )
    if tenant_scoped:
        sums = sums.where(t.c.tenant == bindparam("tenant", type_=String))
    parts: list[Any] = [sums]
    for figured in (
        _sql_figures(dialect, now, [*in_sql, _busy(jobs)], ("tenant", "queue")).subquery("busy"),
        _idle_waiting(now, [*in_sql, ~_busy(jobs)]).subquery("idle"),
    ):
        f = figured.c
        parts.append(
            select(
                literal("live").label("kind"),
                f.tenant,
                f.queue,
                literal("").label("id"),
                f.jobs,
                *(f[c] for c in CATEGORIES),
            )
        )
    parts.append(
        select(
            literal("mig").label("kind"),
            jobs.c.tenant,
            jobs.c.queue,
            jobs.c.id,
            literal(0).label("jobs"),
            *(literal(0.0).label(c) for c in CATEGORIES),
        ).where(*in_python, bindparam("mig", type_=Boolean))
    )
    return select(*(jobs.c[c] for c in _LIVE_COLUMNS)).where(*in_python), union_all(*parts)


def _read_totals(conn: Connection, now: float, since: float, tenant: str | None, out: GoodputRead) -> None:
    """The total (and its parts): goodput_totals' sums plus the live figures of the jobs not accounted.

    Two statements, three when MIG gangs are not accounted: (1) the MIG gangs not accounted (_figured_in_python),
    (2) their attempts, then (3) one statement (UNION ALL) with the sums, the figures of every other job not
    accounted computed in SQL (_sql_figures for those ever reserved or finished, _idle_waiting for the queued), and
    the ids of the MIG gangs still not accounted. Everything but the MIG gangs is thus read in one statement, as of
    one moment: exact whatever the isolation (each job is either in the sums or not accounted, never both: every
    writer moves a job out of "not accounted" and adds its figures to the sums in one transaction, account_finished
    and the archive, retention.py, through mark_accounted; nothing makes a job not accounted again).

    A MIG gang read in (1) counts from its live figures only when (3) still finds it not accounted, which keeps them
    exact outside a snapshot too (PostgreSQL's READ COMMITTED reads each statement as of its own start, and a job
    may be accounted or archived between them): as of (3) each is either in the sums or in (3)'s ids, never both; a
    gang not in (1) was accounted already (then it is in the sums of (3), which only grow) or did not exist yet.
    The scheduler reads in one snapshot anyway (SchedulerService.read(snapshot=True))."""
    in_python, totals = _totals_statements(conn.dialect.name, tenant is not None)
    params = {"now": float(now), "since": float(since), "first_day": day_of(since), "tenant": tenant}
    rows = conn.execute(in_python, params).mappings().all()  # (1)
    attempts = _attempts_of(conn, [r["id"] for r in rows]) if rows else {}  # (2)
    unaccounted: set[str] = set()
    for row in conn.execute(totals, {**params, "mig": bool(rows)}).mappings().all():  # (3)
        if row["kind"] == "mig":
            unaccounted.add(row["id"])
        elif row["jobs"]:
            out.add(row["tenant"], row["queue"], _archived_goodput(row), int(row["jobs"]))
    by_group: dict[tuple[str, str], list[Goodput]] = {}  # summed per tenant and queue, then added: one add each
    for job in rows:
        if job["id"] in unaccounted:
            figures = job_goodput(job, attempts.get(job["id"], []), now)
            by_group.setdefault((job["tenant"], job["queue"]), []).append(figures)
    for (tenant_name, queue), parts_ in by_group.items():
        out.add(tenant_name, queue, total(parts_), len(parts_))


def read_goodput_report(
    conn: Connection,
    now: float,
    *,
    since: float = 0.0,
    limit: int = 100,
    tenant: str | None = None,
    after: tuple[float, str] | None = None,
    job_ids: Sequence[str] | None = None,
) -> GoodputRead:
    """Goodput without loading the job history: the total (and its per-tenant and per-queue parts) is the sums of
    goodput_totals (every finished job accounted: account_finished, the archive) plus the live figures of the jobs
    not accounted (the active ones, and the finished ones until the leader's upkeep accounts them), read
    through a partial index whatever the number of finished jobs (see _read_totals). The listed jobs are the newest
    `limit` of `jobs` and job_archive together (keyset `after`, newest first), read with LIMIT queries, and only
    their attempts are read.

    `since`: the jobs not accounted (active) and the listed jobs are filtered exactly (submitted at or after
    `since`). Finished jobs, accounted or archived, count by the UTC day they were submitted (goodput_totals'
    bucket): a bucket counts when its day starts at or after `since` rounded down to its UTC day, so a `since`
    inside a day counts all of that day's finished jobs (at a day's start the rule is exact), and a job submitted
    earlier that day that is left out of the total while it runs counts once it finished. `tenant`: only that
    tenant's jobs. `job_ids`: only those jobs, from `jobs` and job_archive, with exact figures and the exact `since`
    (no buckets)."""
    out = GoodputRead()
    jobs, archive = Job.__table__, JobArchive.__table__
    live_where = _job_filter(jobs, since, tenant, job_ids)
    if job_ids is None:
        _read_totals(conn, now, since, tenant, out)
    else:
        # Those jobs exactly: from `jobs` (attempts first: a job archived between the two reads is then simply not
        # found), then from the archive, read last: a job found in both (archived since the first read) counts once,
        # from the archive.
        attempts = _live_attempts(conn, live_where)
        live = list(conn.execute(select(*(jobs.c[c] for c in _LIVE_COLUMNS)).where(*live_where)).mappings())
        archived: set[str] = set()
        for row in conn.execute(select(archive).where(*_job_filter(archive, since, tenant, job_ids))).mappings():
            archived.add(row["id"])
            out.add(row["tenant"], row["queue"], _archived_goodput(row), 1)
        for job in live:
            if job["id"] not in archived:
                out.add(job["tenant"], job["queue"], job_goodput(job, attempts.get(job["id"], []), now), 1)
    if limit <= 0:
        return out
    # The listed jobs: the newest `limit` + 1 of each table (the extra one tells whether more follow), merged. The
    # archive is read last: a job archived since `newest` (or since its attempts) was read is listed from it, once.
    order = (jobs.c.submitted_at.desc(), jobs.c.id.desc())
    newest = list(
        conn.execute(
            select(*(jobs.c[c] for c in (*_LIVE_COLUMNS, "name", "preempted_by")))
            .where(*live_where, *_older_than(jobs, after))
            .order_by(*order)
            .limit(limit + 1)
        )
        .mappings()
        .all()
    )
    listed_attempts = ledger.read_attempts(conn, [j["id"] for j in newest]) if newest else {}
    old = list(
        conn.execute(
            select(archive)
            .where(*_job_filter(archive, since, tenant, job_ids), *_older_than(archive, after))
            .order_by(archive.c.submitted_at.desc(), archive.c.id.desc())
            .limit(limit + 1)
        )
        .mappings()
        .all()
    )
    merged: list[tuple[Any, Goodput, int]] = []
    archived_ids = {row["id"] for row in old}
    for job in newest:
        if job["id"] in archived_ids:  # archived between the two reads: listed once, from the archive
            continue
        rows = listed_attempts.get(job["id"], [])
        merged.append((job, job_goodput(job, rows, now), len(rows)))
    for row in old:
        shown = {
            "id": row["id"],
            "name": row["name"],
            "state": row["state"],
            "preempted_by": "",
            "submitted_at": row["submitted_at"],
            "archived": True,
        }
        merged.append((shown, _archived_goodput(row), int(row["attempts"] or 0)))
    merged.sort(key=lambda item: (item[0]["submitted_at"], item[0]["id"]), reverse=True)
    out.listed = merged[:limit]
    if len(merged) > limit:
        last = out.listed[-1][0]
        out.after = (float(last["submitted_at"]), str(last["id"]))
    return out


def read_goodput(
    conn: Connection,
    now: float,
    *,
    job_ids: Sequence[str] | None = None,
    since: float = 0.0,
    limit: int = 100,
    tenant: str | None = None,
) -> tuple[Goodput, list[tuple[Any, Goodput, int]], int]:
    """(the total over every job submitted since `since`, the newest `limit` of them with theirs and their attempt
    counts, how many jobs the total counts). `tenant`: only that tenant's jobs (the total too). Finished jobs count
    through goodput_totals, by their UTC day of submission (see read_goodput_report, which this wraps)."""
    got = read_goodput_report(conn, now, since=since, limit=limit, tenant=tenant, job_ids=job_ids)
    return got.total, got.listed, got.job_count


def to_proto(g: Goodput) -> common_pb2.Goodput:
    return common_pb2.Goodput(
        allocated=g.allocated,
        productive=g.productive,
        rollback=g.rollback,
        restart=g.restart,
        waiting=g.waiting,
        ratio=g.ratio,
    )


# ---- pages of the goodput job list (GetGoodput; tokens as services/scheduler/paging.py makes them) ------------------


def page_digest(since: float, tenant: str | None) -> str:
    """What a goodput page token is bound to: the `since` of the first page and the caller's tenant scope."""
    return paging.filter_digest("goodput", float(since), tenant)


def page_token(after: tuple[float, str] | None, digest: str) -> str:
    """The token of the page after the job keyed `after` ("" when no page follows)."""
    return "" if after is None else paging.encode("goodput", digest, t=after[0], id=after[1])


def page_after(token: str, digest: str) -> tuple[float, str] | None:
    """The (submitted_at, id) key a goodput page token carries (None for ""); INVALID_ARGUMENT for anything else."""
    if not token:
        return None
    return paging.decode_job_token(token, digest, "goodput")


def group_protos(groups: dict[str, tuple[Goodput, int]]) -> list[scheduler_pb2.GroupGoodput]:
    """GetGoodputResponse.tenants / queues, by name."""
    return [
        scheduler_pb2.GroupGoodput(name=name, goodput=to_proto(g), job_count=n)
        for name, (g, n) in sorted(groups.items())
    ]
