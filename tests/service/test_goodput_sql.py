"""The goodput of a job computed in SQL (accounting._sql_figures, what the total reads for every job not accounted
but MIG gangs) against job_goodput, the Python it stands for, over random jobs and attempts: states, shares, open
attempts in the middle, times out of order, kept checkpoints before, inside and after the work. On SQLite and on
PostgreSQL."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from db.engine import make_engine
from db.models import Job, JobAttempt
from phalanx.core.goodput import CATEGORIES
from services.scheduler import accounting, ledger

NOW = float(int(time.time()))
_ids = itertools.count()

# Times on a small grid around NOW (halves included): every ordering of the attempt's instants is drawn often
instant = st.integers(-40, 40).map(lambda k: NOW + k * 0.5)
maybe_instant = st.none() | instant


@st.composite
def jobs_with_attempts(draw):
    state = draw(st.sampled_from(["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]))
    terminal = state in ("SUCCEEDED", "FAILED", "CANCELLED")
    job = dict(
        name="j",
        state=state,
        replicas=draw(st.integers(1, 4)),
        gpus_per_replica=draw(st.integers(0, 8)),
        gpu_milli=draw(st.sampled_from([0, 0, 250, 1000])),
        command=["train"],
        submitted_at=draw(instant),
        finished_at=draw(st.sampled_from([0.0]) | instant) if terminal else 0.0,
        tenant=draw(st.sampled_from(["a", "b"])),
        queue="q",
    )
    numbers = sorted(draw(st.sets(st.integers(1, 6), max_size=4)))
    attempts = [
        dict(
            attempt=n,
            gpus=float(draw(st.integers(0, 16))) / 2,
            reserved_at=draw(instant),
            running_at=draw(maybe_instant),
            ended_at=draw(maybe_instant),
            outcome=draw(st.sampled_from(["", "SUCCEEDED", "PREEMPTED", "NODE_LOST", "FAILED"])),
            kept_until=draw(maybe_instant),
        )
        for n in numbers
    ]
    job["attempt"] = numbers[-1] if numbers else 0
    return job, attempts


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    yield e
    e.dispose()


def _seed(engine, drawn) -> list[str]:
    ids = []
    with engine.begin() as conn:
        for job, attempts in drawn:
            job_id = f"g{next(_ids):011d}"
            ids.append(job_id)
            conn.execute(insert(Job).values(id=job_id, **job))
            for a in attempts:
                conn.execute(insert(JobAttempt).values(job_id=job_id, **a))
    return ids


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(jobs_with_attempts(), min_size=1, max_size=12), now=instant)
def test_each_jobs_figures_in_sql_are_job_goodputs(engine, drawn, now):
    ids = _seed(engine, drawn)
    jobs = Job.__table__
    with engine.connect() as conn:
        stmt = accounting._sql_figures(conn.dialect.name, now, [jobs.c.id.in_(ids)], ("id",))
        got = {r["id"]: r for r in conn.execute(stmt).mappings()}
        rows = {r["id"]: r for r in conn.execute(select(jobs).where(jobs.c.id.in_(ids))).mappings()}
        attempts = ledger.read_attempts(conn, ids)
    assert set(got) == set(ids)
    for job_id in ids:
        expected = accounting.job_goodput(rows[job_id], attempts.get(job_id, []), now)
        assert got[job_id]["jobs"] == 1
        for c in CATEGORIES:
            assert got[job_id][c] == pytest.approx(getattr(expected, c), rel=1e-12, abs=1e-9), (job_id, c)


def test_the_figures_summed_by_tenant_are_the_jobs_sums(engine):
    drawn = [
        (
            dict(
                name="j",
                state=s,
                replicas=2,
                gpus_per_replica=4,
                command=["t"],
                submitted_at=NOW - 100 - i,
                finished_at=NOW - 5 if s != "RUNNING" else 0.0,
                tenant=t,
                queue="q",
                attempt=1,
            ),
            [
                dict(
                    attempt=1,
                    gpus=8.0,
                    reserved_at=NOW - 90,
                    running_at=NOW - 80,
                    ended_at=None if s == "RUNNING" else NOW - 5,
                    outcome="" if s == "RUNNING" else s,
                    kept_until=None,
                )
            ],
        )
        for i, (s, t) in enumerate([("RUNNING", "a"), ("SUCCEEDED", "a"), ("FAILED", "b"), ("RUNNING", "b")])
    ]
    ids = _seed(engine, drawn)
    jobs = Job.__table__
    with engine.connect() as conn:
        by_job = {
            r["id"]: r
            for r in conn.execute(
                accounting._sql_figures(conn.dialect.name, NOW, [jobs.c.id.in_(ids)], ("id",))
            ).mappings()
        }
        by_tenant = {
            r["tenant"]: r
            for r in conn.execute(
                accounting._sql_figures(conn.dialect.name, NOW, [jobs.c.id.in_(ids)], ("tenant", "queue"))
            ).mappings()
        }
    assert {t: r["jobs"] for t, r in by_tenant.items()} == {"a": 2, "b": 2}
    for tenant, members in (("a", ids[:2]), ("b", ids[2:])):
        for c in CATEGORIES:
            assert by_tenant[tenant][c] == pytest.approx(sum(by_job[j][c] for j in members)), (tenant, c)
    # a failed attempt with no checkpoint kept nothing: all its work is rollback
    assert by_job[ids[2]]["productive"] == 0 and by_job[ids[2]]["rollback"] == pytest.approx(8 * 75)
