"""Goodput accounting: a known scenario to the exact GPU-second, in the core and through the ledger."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert

from db.engine import make_engine
from db.models import Checkpoint, Job, JobAttempt
from phalanx.core.goodput import AttemptTimes, Goodput, account_attempt, account_job
from services.scheduler import accounting, ledger
from services.scheduler.state import JobRecord

# 2 replicas x 4 GPUs = 8 GPUs, submitted at t=1000.
#  attempt 1: reserved 1010, all ranks running 1015, step 100 reached (its checkpoint began) 1060, node lost 1100
#  attempt 2: reserved 1130 (backoff, then a free slot), running 1132, checkpoint 1190, preempted 1200
#  attempt 3: reserved 1300, running 1301, succeeded 1400
SCENARIO = [
    AttemptTimes(1, 8, 1010, 1015, 1100, "NODE_LOST", kept_until=1060),
    AttemptTimes(2, 8, 1130, 1132, 1200, "PREEMPTED", kept_until=1190),
    AttemptTimes(3, 8, 1300, 1301, 1400, "SUCCEEDED"),
]
EXPECTED = Goodput(
    allocated=8 * (90 + 70 + 100),  # 2080
    productive=8 * (45 + 58 + 99),  # 1616: 1015->1060, 1132->1190, 1301->1400
    rollback=8 * (40 + 10),  # 400: 1060->1100, 1190->1200
    restart=8 * (5 + 2 + 1),  # 64
    waiting=8 * (10 + 30 + 100),  # 1120: 1000->1010, 1100->1130, 1200->1300
)


def test_known_scenario_to_the_exact_gpu_second():
    got = account_job(1000.0, 8, SCENARIO, now=5000.0, finished_at=1400.0)
    assert got == EXPECTED
    assert got.allocated == got.productive + got.rollback + got.restart
    assert got.ratio == pytest.approx(1616 / 2080)


def test_attempt_that_kept_nothing_rolls_everything_back():
    # The latest committed checkpoint is an older attempt's: this attempt kept none of its work.
    a = AttemptTimes(2, 4, 100, 110, 200, "NODE_LOST", kept_until=None)
    assert account_attempt(a, now=999) == Goodput(allocated=400, productive=0, rollback=360, restart=40)
    # Its ranks never all ran: the whole attempt was restart.
    b = AttemptTimes(1, 4, 100, None, 130, "LAUNCH_TIMEOUT")
    assert account_attempt(b, now=999) == Goodput(allocated=120, restart=120)


def test_running_and_queued_jobs_count_up_to_now():
    running = [AttemptTimes(1, 2, 10, 12, None, "")]
    assert account_job(0, 2, running, now=20) == Goodput(allocated=20, productive=16, restart=4, waiting=20)
    requeued = [AttemptTimes(1, 2, 10, 12, 20, "PREEMPTED", kept_until=18)]
    assert account_job(0, 2, requeued, now=50) == Goodput(
        allocated=20, productive=12, rollback=4, restart=4, waiting=20 + 60
    )
    # Cancelled while queued at 30: waiting stops then.
    assert account_job(0, 2, requeued, now=50, finished_at=30).waiting == 20 + 20
    assert account_job(0, 2, [], now=50) == Goodput(waiting=100)


def test_bad_attempt_orders_and_values_are_refused():
    with pytest.raises(ValueError, match="increasing order"):
        account_job(0, 1, [AttemptTimes(2, 1, 1, 2, 3, "PREEMPTED"), AttemptTimes(1, 1, 4, 5, 6, "SUCCEEDED")], 10)
    with pytest.raises(ValueError, match="gpus"):
        account_attempt(AttemptTimes(1, -1, 0, 1, 2, "SUCCEEDED"), 3)
    with pytest.raises(ValueError, match="finite"):
        account_attempt(AttemptTimes(1, 1, math.nan, 1, 2, "SUCCEEDED"), 3)


times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 64),
            times,
            times,
            times,
            times,
            st.sampled_from(["SUCCEEDED", "PREEMPTED", "NODE_LOST", "FAILED"]),
            st.booleans(),
        ),
        min_size=0,
        max_size=5,
    ),
    times,
)
def test_categories_always_add_up(raw, now):
    attempts, t = [], 0.0
    for i, (g, d1, d2, d3, d4, outcome, kept) in enumerate(raw):
        reserved = t + d1
        running = reserved + d2
        ended = running + d3
        attempts.append(
            AttemptTimes(
                i + 1, g, reserved, running, ended, outcome, kept_until=running + min(d4, d3) if kept else None
            )
        )
        t = ended
    got = account_job(0.0, 8, attempts, now=t + now)
    assert got.allocated == pytest.approx(got.productive + got.rollback + got.restart, rel=1e-9, abs=1e-6)
    assert min(got.allocated, got.productive, got.rollback, got.restart, got.waiting) >= 0


def test_the_ledger_records_what_the_accounting_needs_exactly(db_url):
    """end_attempt reads the kept point from the checkpoints table; read_goodput gives the scenario back exactly."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(Job).values(
                    id="goodput00001",
                    name="g",
                    state="SUCCEEDED",
                    replicas=2,
                    gpus_per_replica=4,
                    command=["x"],
                    attempt=3,
                    submitted_at=1000.0,
                    finished_at=1400.0,
                )
            )
            for a in SCENARIO:
                conn.execute(
                    insert(JobAttempt).values(
                        job_id="goodput00001",
                        attempt=a.attempt,
                        gpus=a.gpus,
                        reserved_at=a.reserved_at,
                        running_at=a.running_at,
                    )
                )
        # In time order: step 100 commits in attempt 1 (begun 1060), which a node loss ends; step 180 commits in
        # attempt 2 (begun 1190) and a later one aborts (it does not count), then a preemption; attempt 3 succeeds.
        checkpoints = {
            1: [("c1", 1, 100, "COMMITTED", 1060.0)],
            2: [("c2", 2, 180, "COMMITTED", 1190.0), ("c3", 2, 190, "ABORTED", 1195.0)],
            3: [],
        }
        ends = {
            1: ("NODE_LOST", 1100.0, (100, 1060.0)),
            2: ("PREEMPTED", 1200.0, (180, 1190.0)),
            3: ("SUCCEEDED", 1400.0, (180, None)),
        }
        for attempt in (1, 2, 3):
            with engine.begin() as conn:
                for cid, at_attempt, step, state, created in checkpoints[attempt]:
                    conn.execute(
                        insert(Checkpoint).values(
                            id=cid,
                            job_id="goodput00001",
                            attempt=at_attempt,
                            step=step,
                            state=state,
                            created_at=created,
                            committed_at=created + 3 if state == "COMMITTED" else None,
                        )
                    )
                job = JobRecord(
                    id="goodput00001",
                    name="g",
                    state="RUNNING",
                    priority=0,
                    replicas=2,
                    gpus_per_replica=4,
                    procs_per_replica=0,
                    command=["x"],
                    env={},
                    submitted_at=1000.0,
                    attempt=attempt,
                )
                outcome, at, expected = ends[attempt]
                assert ledger.end_attempt(conn, job, outcome, "test", at) == expected
        with engine.begin() as conn:
            rows = ledger.read_attempts(conn, ["goodput00001"])["goodput00001"]
            assert [(r["outcome"], r["committed_step"], r["kept_until"]) for r in rows] == [
                ("NODE_LOST", 100, 1060.0),
                ("PREEMPTED", 180, 1190.0),
                ("SUCCEEDED", 180, None),
            ]
            total, listed, count = accounting.read_goodput(conn, 9999.0)
        assert count == 1 and total == EXPECTED and listed[0][1] == EXPECTED and listed[0][2] == 3
    finally:
        engine.dispose()
