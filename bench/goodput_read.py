"""The goodput read (GetGoodput's first page: accounting.read_goodput_report) at the size of bench/live_scale.py,
without the rest of the cluster: what the read itself costs the database and Python.

A scratch PostgreSQL database gets the ledger's schema and:
- --history finished jobs, accounted (goodput_totals), each with one attempt (live_scale's seed_history);
- --pending queued jobs never reserved (they only wait);
- --running jobs with a running attempt, a fifth of them with an earlier preempted attempt too;
then the read runs --samples times in one snapshot each (REPEATABLE READ, as the scheduler reads it), and once
under cProfile for where its time goes (SQL statements against Python).

The baseline, in the same run: the same read with every job ever reserved figured in Python, as the read had it
before (accounting._figured_in_python replaced by figured_in_python_before: those jobs' rows and attempts are
fetched and job_goodput runs per job), on the same database.

Target (issue 35): every paginated read p99 under 100 ms at 4,096 nodes and 10,000 pending; this bench times the
read alone, the scheduler's reply adds its process (live_scale measures that).

Run: .venv/bin/python bench/goodput_read.py [--pending 10000] [--running 920] [--history 100000] [--samples 40]
     [--db URL] [--no-targets]
The last line on stdout is one JSON object with every figure; exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg
from live_scale import SHAPES, seed_history
from sqlalchemy import func, insert, or_

from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.models import Job, JobAttempt
from phalanx.common.logging import configure_logging
from services.common import gcwatch
from services.scheduler import accounting

TARGET_P99_MS = 100.0


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def seed_live(db_url: str, pending: int, running: int) -> None:
    """Queued jobs (attempt 0, no attempt row) and running ones (an attempt each; every fifth one preempted once
    before), submitted over the last hours, in tenants and queues as a shared cluster has them."""
    engine = make_engine(db_url)
    now = time.time()
    rng = random.Random(11)
    jobs, attempts = [], []
    for i in range(pending + running):
        (replicas, gpus), _ = rng.choices(SHAPES, [w for _, w in SHAPES])[0]
        runs = i >= pending
        submitted = now - rng.uniform(60, 6 * 3600)
        job_id = f"l{i:011d}{uuid.uuid4().hex[:8]}"
        tries = (2 if i % 5 == 0 else 1) if runs else 0
        jobs.append(
            dict(
                id=job_id,
                name=f"live-{i}",
                state="RUNNING" if runs else "PENDING",
                priority=0,
                replicas=replicas,
                gpus_per_replica=gpus,
                procs_per_replica=1,
                command=["train.py"],
                env={},
                attempt=tries,
                placement={},
                submitted_at=submitted,
                started_at=submitted + 30 if runs else 0.0,
                finished_at=0.0,
                version=1,
                struck_nodes=[],
                tenant=f"team-{i % 7}",
                queue=f"q{i % 3}",
            )
        )
        at = submitted + 30
        for attempt in range(1, tries + 1):
            last = attempt == tries
            ended = None if last else at + rng.uniform(60, 600)
            attempts.append(
                dict(
                    job_id=job_id,
                    attempt=attempt,
                    gpus=float(replicas * gpus),
                    reserved_at=at,
                    running_at=at + 5,
                    ended_at=ended,
                    outcome="" if last else "PREEMPTED",
                    reason="",
                    kept_until=None if last else at + 30,
                )
            )
            at = (ended or at) + 10
    with engine.begin() as conn:
        for start in range(0, len(jobs), 5000):
            conn.execute(insert(Job), jobs[start : start + 5000])
        if attempts:
            conn.execute(insert(JobAttempt), attempts)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")  # what autovacuum does on a cluster that has run a while
    engine.dispose()


def figured_in_python_before(jobs):
    """The baseline: the read's jobs figured in Python as before their figures moved into SQL (every job ever
    reserved or finished, and MIG gangs)."""
    return or_(
        accounting._busy(jobs),
        func.coalesce(jobs.c.mig_profile, "") != "",
    )


def time_reads(db_url: str, samples: int) -> tuple[list[float], accounting.GoodputRead]:
    engine = make_engine(db_url)
    took: list[float] = []
    got = accounting.GoodputRead()
    try:
        for _ in range(samples + 2):  # the first two warm the connection and the statement caches
            t = time.perf_counter()
            with engine.connect() as conn:
                conn = conn.execution_options(isolation_level="REPEATABLE READ", readonly=True)
                with conn.begin():
                    got = accounting.read_goodput_report(conn, time.time(), limit=100)
            took.append(time.perf_counter() - t)
    finally:
        engine.dispose()
    return took[2:], got


def profile_read(db_url: str) -> dict[str, float]:
    """One read under cProfile: its seconds in the driver's execute (the SQL) and in the rest (Python)."""
    engine = make_engine(db_url)
    profiler = cProfile.Profile()
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="REPEATABLE READ", readonly=True)
            with conn.begin():
                accounting.read_goodput_report(conn, time.time(), limit=100)  # warm
            with conn.begin():
                profiler.enable()
                accounting.read_goodput_report(conn, time.time(), limit=100)
                profiler.disable()
    finally:
        engine.dispose()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    sql = sum(
        ct
        for (file, _, name), (_, _, _, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
        if name == "execute" and "psycopg" in file and "cursor" in file
    )
    return {"profiled_ms": total * 1000, "sql_ms": sql * 1000, "python_ms": (total - sql) * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=920)
    parser.add_argument("--history", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument(
        "--db", default=os.environ.get("PHALANX_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
    )
    parser.add_argument("--no-targets", action="store_true")
    args = parser.parse_args()
    configure_logging("goodput-bench")  # (to stderr: stdout ends with the JSON line)

    admin = normalize_url(args.db).replace("postgresql+psycopg://", "postgresql://")
    name = f"phalanx_goodput_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = admin.rsplit("/", 1)[0] + "/" + name
    results: dict = {"pending": args.pending, "running": args.running, "history": args.history}
    try:
        upgrade(db_url)
        t = time.perf_counter()
        seed_history(db_url, args.history)
        seed_live(db_url, args.pending, args.running)
        say(
            f"seeded {args.history} finished, {args.pending} pending, {args.running} running in "
            f"{time.perf_counter() - t:.1f} s"
        )
        gcwatch.install()  # the scheduler's collection policy (freeze what survived): its reads run under it
        current = accounting._figured_in_python
        for label, in_python in (("baseline", figured_in_python_before), ("read", current)):
            accounting._figured_in_python = in_python
            accounting._totals_statements.cache_clear()  # (built with the predicate in place)
            took, got = time_reads(db_url, args.samples)
            results[f"{label}_p50_ms"] = round(pct(took, 50) * 1000, 1)
            results[f"{label}_p99_ms"] = round(pct(took, 99) * 1000, 1)
            results[f"{label}_jobs_counted"] = got.job_count
            results[f"{label}_allocated"] = round(got.total.allocated, 1)
            results.update({f"{label}_{k}": round(v, 1) for k, v in profile_read(db_url).items()})
            say(
                f"{label:9s} p50 {results[f'{label}_p50_ms']} ms, p99 {results[f'{label}_p99_ms']} ms "
                f"(profiled: SQL {results[f'{label}_sql_ms']} ms, Python {results[f'{label}_python_ms']} ms); "
                f"{got.job_count} jobs counted"
            )
        accounting._figured_in_python = current
        accounting._totals_statements.cache_clear()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    # The two reads must agree: the same jobs counted (the figures move with the clock between them)
    results["same_count"] = results["baseline_jobs_counted"] == results["read_jobs_counted"]
    missed = []
    if results["read_p99_ms"] >= TARGET_P99_MS:
        missed.append(f"read p99 {results['read_p99_ms']} ms >= {TARGET_P99_MS} ms")
    if not results["same_count"]:
        missed.append("the read and its baseline counted different jobs")
    results["targets_missed"] = missed
    say("targets: " + ("all met" if not missed else "; ".join(missed)))
    print(json.dumps(results))
    return 1 if missed and not args.no_targets else 0


if __name__ == "__main__":
    sys.exit(main())
