"""Retention of finished jobs (services/scheduler/retention.py): the archive, goodput from goodput_totals plus the
live ledger, `phalanx db prune`, GetJob of an archived job, and pages of the goodput job list. Every database test
runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import grpc
import pytest
from sqlalchemy import func, insert, select

from db.engine import make_engine
from db.models import (
    Allocation,
    Assignment,
    Base,
    Checkpoint,
    CheckpointRequest,
    CheckpointRestore,
    CheckpointShard,
    CheckpointStepReport,
    Claim,
    GoodputTotals,
    Gpu,
    Job,
    JobArchive,
    JobAttempt,
    Node,
    Rank,
)
from phalanx.api.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from phalanx.cli.main import main as cli_main
from phalanx.client import Client, InvalidArgumentError
from phalanx.core.goodput import CATEGORIES, Goodput
from services.scheduler import accounting, paging, retention
from services.scheduler.main import build_parser, serve
from services.scheduler.settings import SchedulerSettings

DAY = 86400.0
NOW = float(int(time.time()) - 3600)  # an hour ago: every time below is relative to it (the CLI refuses the future)
BEFORE = NOW - 30 * DAY


# ---- seeding the ledger --------------------------------------------------------------------------------------------


def _jid(n: int) -> str:
    return f"{n:012x}"


def _node(conn, node_id: int = 1, acked: int = 5) -> None:
    conn.execute(
        insert(Node).values(
            id=node_id,
            name=f"n{node_id}",
            state="READY",
            gpus=2,
            registered_at=0,
            last_heartbeat=0,
            revision=10,
            acked_revision=acked,
        )
    )
    conn.execute(insert(Gpu).values(id=node_id * 10, node_id=node_id, index=0))
    conn.execute(insert(Gpu).values(id=node_id * 10 + 1, node_id=node_id, index=1))


def _job(
    conn,
    n: int,
    *,
    state: str = "SUCCEEDED",
    submitted: float,
    finished: float = 0.0,
    tenant: str = "",
    queue: str = "default",
    attempts: int = 2,
    replicas: int = 2,
    gpus: int = 2,
) -> str:
    """A job with `attempts` attempts: each queued 10 s, restarting 5 s, working 100 s; all but the last torn down
    (kept up to 60 s of its work), the last SUCCEEDED (or, for an active job, still running)."""
    job_id = _jid(n)
    active = state in ("PENDING", "RUNNING")
    conn.execute(
        insert(Job).values(
            id=job_id,
            name=f"job-{n}",
            state=state,
            priority=n % 3,
            replicas=replicas,
            gpus_per_replica=gpus,
            command=["train", str(n)],
            env={"SECRET": "x"},
            attempt=attempts,
            message=f"message {n}",
            exit_code=n % 5,
            submitted_at=submitted,
            started_at=submitted + 10 if attempts else 0.0,
            finished_at=0.0 if active else finished,
            tenant=tenant,
            queue=queue,
            placement={"tier": "node", "domains": 1, "score": 1.0, "reason": "packed"},
        )
    )
    t = submitted
    for a in range(1, attempts + 1):
        last = a == attempts
        reserved, running = t + 10, t + 15
        ended = None if (last and active) else running + 100
        conn.execute(
            insert(JobAttempt).values(
                job_id=job_id,
                attempt=a,
                gpus=float(replicas * gpus),
                reserved_at=reserved,
                running_at=running,
                ended_at=ended,
                outcome="" if ended is None else ("SUCCEEDED" if last else "PREEMPTED"),
                reason="" if last else "preempted",
                kept_until=None if last else running + 60,
            )
        )
        t = ended or t
    return job_id


def _dependents(conn, job_id: str, *, node_id: int = 1, released: bool = True, revision: int = 1) -> None:
    """A row about the job in every table that refers to it."""
    conn.execute(
        insert(Allocation).values(
            job_id=job_id,
            attempt=1,
            replica=0,
            node_id=node_id,
            gpu_id=node_id * 10,
            gpu_index=0,
            reserved_at=1.0,
            released_at=2.0 if released else None,
        )
    )
    conn.execute(
        insert(Rank).values(
            job_id=job_id, attempt=1, rank=0, replica=0, local_rank=0, node_id=node_id, state="EXITED", updated_at=1.0
        )
    )
    conn.execute(
        insert(Checkpoint).values(id="c" + job_id, job_id=job_id, attempt=1, step=7, state="COMMITTED", created_at=1.0)
    )
    conn.execute(insert(CheckpointShard).values(checkpoint_id="c" + job_id, rank=0, uri=f"file:///ck/{job_id}/0"))
    conn.execute(insert(CheckpointRequest).values(job_id=job_id, reason="user", requested_at=1.0))
    conn.execute(
        insert(CheckpointStepReport).values(job_id=job_id, attempt=1, rank=0, step=3, requested_at=1.0, reported_at=1.0)
    )
    conn.execute(insert(CheckpointRestore).values(job_id=job_id, attempt=1, rank=0, reported_at=1.0))
    conn.execute(  # a claim it made once, as a preemptor (ended)
        insert(Claim).values(
            job_id=job_id, replicas=[{"node": "n", "gpus": [0]}], victims=[], created_at=1.0, ended_at=2.0
        )
    )
    conn.execute(
        insert(Assignment).values(
            node_id=node_id, revision=revision, job_id=job_id, attempt=1, kind="launch", payload=b"x", created_at=1.0
        )
    )


def _tables_with_job_id():
    return [t for t in Base.metadata.sorted_tables if "job_id" in t.c and t.name not in ("job_archive",)]


def _rows_of(conn, job_id: str) -> dict[str, int]:
    out = {
        t.name: conn.execute(select(func.count()).select_from(t).where(t.c.job_id == job_id)).scalar()
        for t in _tables_with_job_id()
    }
    shards = CheckpointShard.__table__
    out["checkpoint_shards"] = conn.execute(
        select(func.count()).select_from(shards).where(shards.c.checkpoint_id == "c" + job_id)
    ).scalar()
    out["jobs"] = conn.execute(select(func.count()).select_from(Job).where(Job.id == job_id)).scalar()
    return out


def _read(engine, now: float = NOW, **kw) -> accounting.GoodputRead:
    with engine.connect() as conn, conn.begin():
        return accounting.read_goodput_report(conn, now, **kw)


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


def _counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t.name: conn.execute(select(func.count()).select_from(t)).scalar()
            for t in Base.metadata.sorted_tables
            if t.name in ("jobs", "job_archive", "job_attempts", "goodput_totals", "allocations", "ranks")
        }


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    yield e
    e.dispose()


# ---- the archive -------------------------------------------------------------------------------------------------


def test_archive_moves_exactly_the_old_finished_jobs_and_every_row_about_them(engine):
    with engine.begin() as conn:
        _node(conn, acked=5)
        old = {
            _job(conn, 1, state="SUCCEEDED", submitted=NOW - 41 * DAY, finished=NOW - 40 * DAY),
            _job(conn, 2, state="FAILED", submitted=NOW - 41 * DAY, finished=NOW - 35 * DAY),
            _job(conn, 3, state="CANCELLED", submitted=NOW - 41 * DAY, finished=BEFORE - 1, attempts=0),
        }
        recent = _job(conn, 4, state="SUCCEEDED", submitted=NOW - 41 * DAY, finished=BEFORE + 1)
        running = _job(conn, 5, state="RUNNING", submitted=NOW - 60 * DAY)
        pending = _job(conn, 6, state="PENDING", submitted=NOW - 60 * DAY, attempts=0)
        # Finished long ago, but still the holder of a GPU's active hold row (other jobs' shares on it): it waits.
        holder = _job(conn, 7, state="SUCCEEDED", submitted=NOW - 41 * DAY, finished=NOW - 40 * DAY)
        for i, job_id in enumerate(sorted(old)):
            _dependents(conn, job_id, revision=i + 1)  # revisions 1-3: acknowledged by the node (acked 5)
        unacked = _jid(1)
        conn.execute(
            insert(Assignment).values(
                node_id=1, revision=9, job_id=unacked, attempt=1, kind="kill", payload=b"k", created_at=1.0
            )
        )
        for i, job_id in enumerate((recent, running, holder)):
            _dependents(conn, job_id, released=job_id != holder, revision=4 + i if i < 2 else 8)
        expected = {}
        for job_id in old:
            rows = (
                conn.execute(
                    select(JobAttempt.__table__).where(JobAttempt.job_id == job_id).order_by(JobAttempt.attempt)
                )
                .mappings()
                .all()
            )
            job = conn.execute(select(Job.__table__).where(Job.id == job_id)).mappings().one()
            expected[job_id] = (accounting.job_goodput(job, rows, NOW), len(rows))

    assert retention.archive_finished(engine, BEFORE, now=NOW) == 3
    with engine.connect() as conn:
        archived = {r["id"]: r for r in conn.execute(select(JobArchive.__table__)).mappings()}
        assert set(archived) == old
        left = set(conn.execute(select(Job.id)).scalars())
        assert left == {recent, running, pending, holder}
        for job_id in old:
            rows = _rows_of(conn, job_id)
            # every dependent row is gone, but the assignment its node has not acknowledged yet (revision 9 > 5)
            assert {k: v for k, v in rows.items() if v} == ({"assignments": 1} if job_id == unacked else {}), job_id
            r = archived[job_id]
            g, n = expected[job_id]
            _close(Goodput(**{c: r[c] for c in CATEGORIES}), g)
            assert r["attempts"] == n and r["archived_at"] == NOW
            n_ = int(job_id, 16)
            assert r["message"] == f"message {n_}" and r["exit_code"] == n_ % 5 and r["name"] == f"job-{n_}"
            assert r["detail"]["command"] == ["train", str(n_)] and "env" not in r["detail"]
            assert r["detail"]["checkpoints"] == [{"id": "c" + job_id, "attempt": 1, "step": 7}]
            assert [a["attempt"] for a in r["detail"]["attempts"]] == list(range(1, n + 1))
        for job_id in (recent, running, holder):
            assert all(_rows_of(conn, job_id).values()), job_id  # nothing of theirs was touched
        totals = conn.execute(select(GoodputTotals.__table__)).mappings().all()
        assert sum(t["jobs"] for t in totals) == 3
        assert {t["day"] for t in totals} == {accounting.day_of(NOW - 41 * DAY)}
    assert retention.archive_finished(engine, BEFORE, now=NOW) == 0  # idempotent: nothing more is due


def test_goodput_is_the_same_before_and_after_archiving_with_tenant_and_queue_parts(engine):
    with engine.begin() as conn:
        n = 0
        for tenant in ("alice", "bob", ""):
            for queue in ("default", "research"):
                for age in (90, 45, 31, 10):  # days since it finished; 90/45/31 are due
                    n += 1
                    _job(
                        conn,
                        n,
                        state=("SUCCEEDED", "FAILED", "CANCELLED")[n % 3],
                        submitted=NOW - (age + 1) * DAY - n * 977.0,
                        finished=NOW - age * DAY,
                        tenant=tenant,
                        queue=queue,
                        attempts=1 + n % 3,
                        replicas=1 + n % 2,
                        gpus=1 + n % 4,
                    )
                n += 1
                _job(conn, n, state="RUNNING", submitted=NOW - 5 * DAY, tenant=tenant, queue=queue)
    before = _read(engine)
    by_tenant = {t: (before.tenants[t][1]) for t in before.tenants}
    assert by_tenant == {"alice": 10, "bob": 10, "": 10} and {q: before.queues[q][1] for q in before.queues} == {
        "default": 15,
        "research": 15,
    }
    alice_before = _read(engine, tenant="alice")
    assert set(alice_before.tenants) == {"alice"} and alice_before.job_count == 10
    listed_before = [(j["id"], g, k) for j, g, k in _read(engine, limit=1000).listed]

    archived = retention.archive_finished(engine, BEFORE, now=NOW, batch=4)  # several transactions
    assert archived == 18
    counts = _counts(engine)
    assert counts["jobs"] == 12 and counts["job_archive"] == 18
    after = _read(engine)
    _same(before, after)
    _same(alice_before, _read(engine, tenant="alice"))
    listed_after = [(j["id"], g, k) for j, g, k in _read(engine, limit=1000).listed]
    assert [x[0] for x in listed_after] == [x[0] for x in listed_before]  # archived jobs are listed too
    for (_, g_before, k_before), (_, g_after, k_after) in zip(listed_before, listed_after):
        _close(g_after, g_before)
        assert k_after == k_before
    # the sums are the archive's: every archived job counted once
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(GoodputTotals.jobs))).scalar() == 18
        archived_alloc = conn.execute(select(func.sum(JobArchive.allocated))).scalar()
        assert conn.execute(select(func.sum(GoodputTotals.allocated))).scalar() == pytest.approx(archived_alloc)
    # the wrapper the metrics and GetJob use agrees
    with engine.connect() as conn:
        total, listed, count = accounting.read_goodput(conn, NOW, limit=0)
    assert count == before.job_count and listed == []
    _close(total, before.total)


def test_since_counts_finished_jobs_by_their_utc_day_of_submission(engine):
    """Finished jobs, archived or accounted (goodput_totals), count by the UTC day they were submitted; the active
    ones (not accounted) and the listed jobs are filtered exactly."""
    day = accounting.day_of(NOW - 60 * DAY)
    with engine.begin() as conn:
        early = _job(conn, 1, submitted=day + 1 * 3600, finished=NOW - 50 * DAY)  # archived, 01:00 that day
        late = _job(conn, 2, submitted=day + 20 * 3600, finished=NOW - 50 * DAY)  # archived, 20:00
        _job(conn, 3, submitted=day - 3600, finished=NOW - 50 * DAY)  # archived, the day before
        done_early = _job(conn, 4, submitted=day + 10 * 3600, finished=NOW - 1 * DAY)  # accounted, 10:00
        done_late = _job(conn, 5, submitted=day + 14 * 3600, finished=NOW - 1 * DAY)  # accounted, 14:00
        run_early = _job(conn, 6, state="RUNNING", submitted=day + 11 * 3600)  # active, 11:00
        run_late = _job(conn, 7, state="RUNNING", submitted=day + 15 * 3600)  # active, 15:00
        assert accounting.account_finished(conn, [done_early, done_late, run_early], NOW) == 2
    assert retention.archive_finished(engine, BEFORE, now=NOW) == 3
    noon = day + 12 * 3600
    got = _read(engine, since=noon, limit=100)
    # finished jobs by day (noon rounds down to the day: 01:00, 10:00, 14:00 and 20:00 count, the day before's
    # does not); active ones exactly (15:00 only)
    counted = [early, late, done_early, done_late, run_late]
    assert got.job_count == 5
    _close(got.total, _read(engine, job_ids=counted).total)  # each job's own figures, summed
    assert [j["id"] for j, _, _ in got.listed] == [late, run_late, done_late]  # the list is exact
    at_day = _read(engine, since=day, limit=0)  # a day's start: exactly the jobs submitted since
    assert at_day.job_count == 6
    _close(at_day.total, _read(engine, job_ids=[*counted, run_early]).total)
    assert _read(engine, since=day + DAY).job_count == 0  # the next day: no job of that day counts
    assert _read(engine, since=0).job_count == 7
    assert {j["id"] for j, _, _ in _read(engine, since=day + 9 * 3600).listed} == {
        late,
        done_late,
        done_early,
        run_early,
        run_late,
    }
    assert _read(engine, job_ids=counted, since=noon).job_count == 3  # job_ids: exact, with the exact `since`


def test_two_archivers_racing_archive_each_job_once(engine):
    with engine.begin() as conn:
        for n in range(1, 61):
            _job(conn, n, submitted=NOW - 50 * DAY + n, finished=NOW - 40 * DAY + n, tenant=f"t{n % 3}")
    before = _read(engine)
    results: list[int] = []
    errors: list[BaseException] = []

    def run():
        try:
            results.append(retention.archive_finished(engine, BEFORE, now=NOW, batch=5, max_batches=100))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    retention.archive_finished(engine, BEFORE, now=NOW, batch=5, max_batches=100)  # whatever a conflict left
    counts = _counts(engine)
    assert counts["jobs"] == 0 and counts["job_archive"] == 60
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(GoodputTotals.jobs))).scalar() == 60
    _same(before, _read(engine))


def test_a_stale_batch_rolls_back_whole_and_counts_nothing(engine):
    with engine.begin() as conn:
        for n in range(1, 5):
            _job(conn, n, submitted=NOW - 50 * DAY, finished=NOW - 40 * DAY)
    with engine.connect() as conn, conn.begin():  # one archiver read the jobs ...
        stale = retention.load_jobs(conn, [_jid(n) for n in range(1, 5)])
    assert retention.archive_finished(engine, BEFORE, now=NOW) == 4  # ... another archived them meanwhile
    with engine.connect() as conn:
        totals_before = conn.execute(select(GoodputTotals.__table__)).mappings().all()
    for keep_rows in (True, False):  # the archive row's key, and (prune) the guarded delete, refuse it
        with pytest.raises(retention.ArchiveConflict):
            with engine.begin() as conn:
                retention.archive_jobs(conn, *stale, NOW, keep_rows=keep_rows)
        with engine.connect() as conn:
            assert conn.execute(select(GoodputTotals.__table__)).mappings().all() == totals_before
    assert _counts(engine)["job_archive"] == 4


# ---- prune -------------------------------------------------------------------------------------------------------


def _seed_for_prune(engine) -> dict[str, set[str]]:
    with engine.begin() as conn:
        _node(conn, acked=100)
        archived = {_job(conn, n, submitted=NOW - 200 * DAY, finished=NOW - (100 + n) * DAY) for n in (1, 2)}
        young_archived = _job(conn, 3, submitted=NOW - 70 * DAY, finished=NOW - 60 * DAY)
        live_old = {_job(conn, n, submitted=NOW - 200 * DAY, finished=NOW - (100 + n) * DAY) for n in (4, 5)}
        live_young = _job(conn, 6, submitted=NOW - 200 * DAY, finished=NOW - 10 * DAY)
        active = _job(conn, 7, state="RUNNING", submitted=NOW - 200 * DAY)
        for i, job_id in enumerate(sorted(live_old)):
            _dependents(conn, job_id, revision=i + 1)
    # archive 1-3 only (jobs 4 and 5 are due too, but stay in `jobs` here: prune takes them from there)
    with engine.begin() as conn:
        jobs, attempts = retention.load_jobs(conn, sorted(archived | {young_archived}))
        retention.archive_jobs(conn, jobs, attempts, NOW)
    return {
        "archived": archived,
        "live_old": live_old,
        "kept": {young_archived, live_young, active},
    }


def test_prune_exports_every_old_finished_job_then_deletes_it_and_totals_keep_their_figures(engine, tmp_path):
    seeded = _seed_for_prune(engine)
    before = _read(engine)
    path = tmp_path / "out.jsonl"
    cutoff = NOW - 90 * DAY
    result = retention.prune(engine, cutoff, str(path), now=NOW)
    assert result == retention.PruneResult(exported=4, deleted=4, file=str(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["job"]["id"]: line for line in lines}
    assert set(by_id) == seeded["archived"] | seeded["live_old"] and len(lines) == 4
    for job_id in seeded["live_old"]:
        line = by_id[job_id]
        assert line["source"] == "jobs" and line["job"]["command"] == ["train", str(int(job_id, 16))]
        assert [a["attempt"] for a in line["attempts"]] == [1, 2] and line["job"]["finished_at"] < cutoff
        assert set(line["goodput"]) == set(CATEGORIES)
    for job_id in seeded["archived"]:
        assert by_id[job_id]["source"] == "job_archive" and "attempts" not in by_id[job_id]
        assert by_id[job_id]["job"]["detail"]["command"] == ["train", str(int(job_id, 16))]
    with engine.connect() as conn:
        left = set(conn.execute(select(Job.id)).scalars()) | set(conn.execute(select(JobArchive.id)).scalars())
        assert left == seeded["kept"]
        for job_id in seeded["live_old"]:
            assert not any(_rows_of(conn, job_id).values())
    _same(before, _read(engine))  # the totals still count the pruned jobs, with the same figures
    again = retention.prune(engine, cutoff, str(tmp_path / "again.jsonl"), now=NOW)
    assert (again.exported, again.deleted) == (0, 0) and (tmp_path / "again.jsonl").read_text() == ""
    with pytest.raises(FileExistsError):  # an export is never overwritten
        retention.prune(engine, cutoff, str(path), now=NOW)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_db_prune_cli_refusals_change_nothing_and_json_reports_counts(engine, db_url, tmp_path, capsys):
    seeded = _seed_for_prune(engine)
    counts = _counts(engine)
    path = tmp_path / "p.jsonl"
    future = time.time() + 3600
    existing = tmp_path / "exists.jsonl"
    existing.write_text("keep me\n")
    for argv, words in [
        (["--before", "2020-01-01"], "--export FILE.jsonl is required"),
        (["--before", "2020-01-01", "--export", str(path), "--no-export"], "not both"),
        (["--before", str(future), "--export", str(path)], "in the future"),
        (["--before", "last tuesday", "--export", str(path)], "--before expects unix seconds or an ISO 8601"),
        (["--before", "-5", "--export", str(path)], "--before must be a time"),
        (["--before", "2020-01-01", "--export", str(existing)], "never overwrites"),
    ]:
        code, out, err = _cli(capsys, "db", "prune", "--db", db_url, *argv)
        assert code == 2 and out == "" and words in err, (argv, err)
        assert _counts(engine) == counts and not path.exists()
    assert existing.read_text() == "keep me\n"
    code, out, err = _cli(capsys, "db", "prune", "--db", db_url, "--export", str(path))  # --before is required
    assert code == 2 and _counts(engine) == counts
    cutoff = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 90 * DAY))
    code, out, err = _cli(capsys, "db", "prune", "--db", db_url, "--before", cutoff, "--export", str(path), "--json")
    assert code == 0, err
    assert json.loads(out) == {"exported": 4, "deleted": 4, "file": str(path)}
    assert {json.loads(line)["job"]["id"] for line in path.read_text().splitlines()} == (
        seeded["archived"] | seeded["live_old"]
    )
    # --no-export, by unix seconds: the young archived and live finished jobs go too; the running one stays
    code, out, err = _cli(capsys, "db", "prune", "--db", db_url, "--before", str(NOW), "--no-export")
    assert code == 0 and out.startswith("deleted 2 finished jobs") and "no export" in out, err
    with engine.connect() as conn:
        assert list(conn.execute(select(Job.state)).scalars()) == ["RUNNING"]
        assert conn.execute(select(func.count()).select_from(JobArchive)).scalar() == 0
        assert conn.execute(select(func.sum(GoodputTotals.jobs))).scalar() == 6


# ---- the scheduler: GetJob, GetGoodput pages, the periodic archive -----------------------------------------------


def _seed_for_api(engine) -> list[str]:
    """Ten finished jobs (five due for the archive) and two running; returns every id newest first."""
    with engine.begin() as conn:
        ids = []
        for n in range(1, 11):
            ids.append(
                _job(
                    conn,
                    n,
                    submitted=NOW - (60 - n) * DAY,
                    finished=(NOW - 40 * DAY) if n <= 5 else time.time() - 60,
                    tenant="alice" if n % 2 else "bob",
                    queue="q1" if n < 4 else "q2",
                )
            )
        for n in (11, 12):
            ids.append(_job(conn, n, state="RUNNING", submitted=NOW - (60 - n) * DAY, tenant="alice", queue="q2"))
    return list(reversed(ids))


async def test_get_job_of_an_archived_job_and_goodput_pages(engine, db_url):
    ids = _seed_for_api(engine)
    assert retention.archive_finished(engine, time.time() - 30 * DAY) == 5
    running = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", retain_finished_s=0.0))
    channel = grpc.aio.insecure_channel(running.address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        # GetJob: an archived job comes back from job_archive
        job = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=_jid(2)))
        assert job.id == _jid(2) and job.state == common_pb2.JOB_STATE_SUCCEEDED and not job.allocations
        assert job.message == "message 2" and job.exit_code == 2 and job.finished_at == NOW - 40 * DAY
        assert job.spec.name == "job-2" and list(job.spec.command) == ["train", "2"] and job.tenant == "bob"
        assert job.spec.queue == "q1" and job.submitted_at == NOW - 58 * DAY and job.attempt == 2
        assert job.goodput.allocated > 0 and job.goodput.allocated == pytest.approx(
            job.goodput.productive + job.goodput.rollback + job.goodput.restart
        )
        live = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=_jid(7)))
        assert live.state == common_pb2.JOB_STATE_SUCCEEDED and live.goodput.allocated > 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=_jid(99)))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        # GetGoodput: breakdowns, and every job once over the pages, newest first
        whole = await stub.GetGoodput(scheduler_pb2.GetGoodputRequest())
        assert whole.job_count == 12 and [j.job_id for j in whole.jobs] == ids and whole.next_page_token == ""
        assert {(t.name, t.job_count) for t in whole.tenants} == {("alice", 7), ("bob", 5)}
        assert {(q.name, q.job_count) for q in whole.queues} == {("q1", 3), ("q2", 9)}
        assert sum(t.goodput.allocated for t in whole.tenants) == pytest.approx(whole.cluster.allocated)
        seen, token, pages = [], "", 0
        while True:
            page = await stub.GetGoodput(scheduler_pb2.GetGoodputRequest(page_size=5, page_token=token))
            pages += 1
            assert len(page.jobs) <= 5 and page.job_count == 12
            assert page.cluster.allocated == pytest.approx(whole.cluster.allocated)
            seen += [j.job_id for j in page.jobs]
            token = page.next_page_token
            if not token:
                break
        assert seen == ids and pages == 3
        assert [j.job_id for j in (await stub.GetGoodput(scheduler_pb2.GetGoodputRequest(limit=4))).jobs] == ids[:4]
        never = await stub.GetGoodput(scheduler_pb2.GetGoodputRequest(since=float("inf")))
        assert never.job_count == 0 and not never.jobs and not never.tenants

        # bad tokens and sizes: INVALID_ARGUMENT, nothing read or changed
        first = await stub.GetGoodput(scheduler_pb2.GetGoodputRequest(page_size=2))
        jobs_token = paging.encode("jobs", paging.filter_digest([], None), t=1.0, id=ids[0])
        raw = base64.urlsafe_b64decode(first.next_page_token + "=" * (-len(first.next_page_token) % 4))
        old_version = base64.urlsafe_b64encode(json.dumps({**json.loads(raw), "v": 99}).encode()).decode()
        bad_key = paging.encode("goodput", accounting.page_digest(0.0, None), t="soon", id=ids[0])
        for request in [
            scheduler_pb2.GetGoodputRequest(page_token="%%%not-base64"),
            scheduler_pb2.GetGoodputRequest(page_token=base64.urlsafe_b64encode(b"not json").decode()),
            scheduler_pb2.GetGoodputRequest(page_token=old_version),
            scheduler_pb2.GetGoodputRequest(page_token=jobs_token),
            scheduler_pb2.GetGoodputRequest(page_token=bad_key),
            scheduler_pb2.GetGoodputRequest(page_token=first.next_page_token, since=5.0),  # another filter
            scheduler_pb2.GetGoodputRequest(page_size=-1),
            scheduler_pb2.GetGoodputRequest(page_size=1001),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetGoodput(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert _counts(engine)["jobs"] == 7 and _counts(engine)["job_archive"] == 5

        # the SDK and the CLI show the breakdowns
        def sdk():
            with Client(running.address, timeout=10) as client:
                return client.goodput(page_size=3), client.goodput(page_size=3, page_token="junk")

        with pytest.raises(InvalidArgumentError, match="invalid page token"):
            await asyncio.to_thread(sdk)

        def sdk_ok():
            with Client(running.address, timeout=10) as client:
                one = client.goodput(page_size=3)
                two = client.goodput(page_size=3, page_token=one.next_page_token)
                return one, two

        one, two = await asyncio.to_thread(sdk_ok)
        assert [j.job_id for j in one.jobs + two.jobs] == ids[:6]
        assert {t.name: t.job_count for t in one.tenants} == {"alice": 7, "bob": 5}
        doc = one.to_dict()
        assert {"cluster", "job_count", "jobs", "tenants", "queues", "next_page_token"} == set(doc)
        assert doc["queues"][0] == {"name": "q1", "job_count": 3, "goodput": one.queues[0].goodput.to_dict()}
    finally:
        await channel.close()
        await running.stop()


async def test_goodput_cli_prints_the_breakdowns(engine, db_url, capsys, service_logs):
    _seed_for_api(engine)
    retention.archive_finished(engine, time.time() - 30 * DAY)
    running = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", retain_finished_s=0.0))
    try:
        code = await asyncio.to_thread(cli_main, ["--scheduler", running.address, "goodput", "--page-size", "2"])
        out, err = capsys.readouterr()
        assert code == 0, err
        lines = out.splitlines()
        tenant_at, queue_at = lines.index("by tenant:"), lines.index("by queue:")
        assert lines[tenant_at + 1].split()[:2] == ["TENANT", "JOBS"]
        assert {tuple(line.split()[:2]) for line in lines[tenant_at + 2 : queue_at - 1]} == {
            ("alice", "7"),
            ("bob", "5"),
        }
        assert lines[-1].startswith("(more jobs: --page-token ")
        code = await asyncio.to_thread(cli_main, ["--scheduler", running.address, "goodput", "--json"])
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert code == 0 and {t["name"]: t["job_count"] for t in doc["queues"]} == {"q1": 3, "q2": 9}
        assert doc["job_count"] == 12 and set(doc["cluster"]) == {*CATEGORIES, "ratio"}
    finally:
        await running.stop()


async def test_the_leading_scheduler_archives_finished_jobs_past_retain_finished(engine, db_url, service_logs):
    with engine.begin() as conn:
        old = _job(conn, 1, submitted=time.time() - 3 * DAY, finished=time.time() - 2 * DAY)
        young = _job(conn, 2, submitted=time.time() - 3 * DAY, finished=time.time() - 60)
        active = _job(conn, 3, state="RUNNING", submitted=time.time() - 3 * DAY)
    before = _read(engine, now=time.time())
    running = await serve(SchedulerSettings(db_url=db_url, listen="127.0.0.1:0", retain_finished_s=DAY))
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _counts(engine)["job_archive"] == 0:
            await asyncio.sleep(0.1)
        with engine.connect() as conn:
            assert list(conn.execute(select(JobArchive.id)).scalars()) == [old]
            assert set(conn.execute(select(Job.id)).scalars()) == {young, active}
        after = _read(engine, now=time.time())
        assert after.job_count == before.job_count == 3
    finally:
        await running.stop()


def test_retain_finished_flag_forms():
    parser = build_parser()
    assert parser.parse_args([]).retain_finished == 30 * DAY
    for text, seconds in [
        ("30d", 30 * DAY),
        ("12h", 43200.0),
        ("90m", 5400.0),
        ("45s", 45.0),
        ("3600", 3600.0),
        ("0", 0.0),
        ("forever", 0.0),
    ]:
        assert parser.parse_args(["--retain-finished", text]).retain_finished == seconds, text
    for bad in ("soon", "-1d", "nan", "d"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--retain-finished", bad])
