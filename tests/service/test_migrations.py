"""The Alembic migrations build the ledger on both stores, and the ledger refuses double booking itself."""

import pytest
from sqlalchemy import insert, inspect, text
from sqlalchemy.exc import IntegrityError

from db.engine import make_engine
from db.migrate import current, head_revision
from db.models import Allocation, Base, Claim, Gpu, Job, Node


def test_upgrade_reaches_head_with_every_table(db_url):
    assert current(db_url) == head_revision()
    engine = make_engine(db_url)
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    assert {t.name for t in Base.metadata.sorted_tables} <= names


def _seed(conn):
    conn.execute(
        insert(Node).values(
            id=1,
            name="n1",
            state="READY",
            message="",
            gpus=1,
            gpu_model="",
            profile="",
            address="",
            topology={},
            fabric_path=[],
            agent_instance="",
            registered_at=0,
            last_heartbeat=0,
            revision=0,
            acked_revision=0,
        )
    )
    conn.execute(insert(Gpu).values(id=1, node_id=1, index=0, uuid="GPU-x", name="H100", memory_mib=1))
    for jid in ("a", "b"):
        conn.execute(
            insert(Job).values(
                id=jid,
                name=jid,
                state="RUNNING",
                priority=0,
                replicas=1,
                gpus_per_replica=1,
                procs_per_replica=0,
                command=["true"],
                env={},
                attempt=1,
                message="",
                exit_code=0,
                placement={},
                submitted_at=0,
                started_at=0,
                finished_at=0,
                version=0,
            )
        )


def _alloc(job_id, released_at=None):
    return insert(Allocation).values(
        job_id=job_id, attempt=1, replica=0, node_id=1, gpu_id=1, gpu_index=0, reserved_at=0, released_at=released_at
    )


def test_database_refuses_a_gpu_in_two_active_allocations(db_url):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        _seed(conn)
        conn.execute(_alloc("a"))
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            conn.execute(_alloc("b"))
    # Once released, the GPU may be taken again, and history keeps both rows.
    with engine.begin() as conn:
        conn.execute(text("UPDATE allocations SET released_at = 1 WHERE job_id = 'a'"))
        conn.execute(_alloc("b"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM allocations")).scalar() == 2
    engine.dispose()


def test_database_refuses_two_standing_claims_for_one_job(db_url):
    """A preemptor has at most one standing claim (revision 0022's partial unique index); ended ones are history."""
    engine = make_engine(db_url)
    row = dict(job_id="a", priority=1, replicas=[{"node": "n1", "gpus": [0]}], victims=["b"], created_at=1.0)
    try:
        with engine.begin() as conn:
            _seed(conn)
            conn.execute(insert(Claim).values(**row, ended_at=5.0, end_reason="replaced"))
            conn.execute(insert(Claim).values(**row))
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(insert(Claim).values(**row))
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM claims WHERE job_id = 'a'")).scalar() == 2
    finally:
        engine.dispose()


def test_a_stale_job_update_in_the_closing_pipeline_rolls_back_everything_sent_with_it(db_url):
    """The cycle sends its jobs' compare-and-set updates, its other writes and its COMMIT together (PostgreSQL's
    pipeline: nothing waits for the updates' row counts). An update whose row moved must fail the transaction in
    the server (phalanx_expect_updated, revision 0026): the COMMIT sent after it rolls back, and nothing is written.
    SQLite checks the row counts as it goes (StaleJobs)."""
    from sqlalchemy.exc import DBAPIError

    from services.scheduler import ledger

    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            _seed(conn)
        # the view read both jobs at version 0; job "b" moved since (another writer)
        with engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET version = 3 WHERE id = 'b'"))
        conn = engine.connect()
        try:
            with pytest.raises((DBAPIError, ledger.StaleJobs)):
                trans = conn.begin()
                with ledger.pipelined(conn):
                    ledger.queue_job_update(conn, "a", 0, {"state": "SUCCEEDED", "finished_at": 5.0})
                    ledger.queue_job_update(conn, "b", 0, {"state": "CANCELLED"})
                    ledger.flush_job_updates(conn, checked_by_server=True)
                    conn.execute(text("UPDATE nodes SET message = 'sent after the updates' WHERE id = 1"))
                    trans.commit()
        finally:
            conn.invalidate()  # as the scheduler does with its connection after a failed cycle (_transaction)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id, state, version FROM jobs ORDER BY id")).all() == [
                ("a", "RUNNING", 0),
                ("b", "RUNNING", 3),
            ]
            assert conn.execute(text("SELECT message FROM nodes")).scalar() == ""
        # the same updates on the versions the ledger holds are written, in one transaction
        with engine.connect() as conn:
            trans = conn.begin()
            with ledger.pipelined(conn):
                ledger.queue_job_update(conn, "a", 0, {"state": "SUCCEEDED", "finished_at": 5.0})
                ledger.queue_job_update(conn, "b", 3, {"state": "CANCELLED"})
                ledger.flush_job_updates(conn, checked_by_server=True)
                trans.commit()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id, state, version FROM jobs ORDER BY id")).all() == [
                ("a", "SUCCEEDED", 1),
                ("b", "CANCELLED", 4),
            ]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_fence_takes_the_clock_row_and_refuses_a_moved_generation_or_a_lost_lease(pg_url):
    """phalanx_fence (revision 0027), which a leader sends first with its closing writes instead of waiting for the
    clock row's lock before deciding: it locks the row to the commit, and fails the transaction (40001) unless the
    row holds the generation the view was built on and the caller's lease, unexpired by the database's clock."""
    from sqlalchemy.exc import OperationalError

    from services.scheduler import ledger

    engine = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE ledger_clock SET generation = 7, leader = 'a', leader_epoch = 3, "
                    "leader_until = extract(epoch FROM clock_timestamp()) + 60 WHERE id = 1"
                )
            )

        def refused(generation: int, replica: str, epoch: int) -> bool:
            with engine.connect() as conn, conn.begin():
                try:
                    ledger.fence(conn, generation, replica, epoch)
                except ledger.StaleJobs as exc:
                    assert ledger.fence_refused(exc)
                    return True
                return False

        assert refused(6, "a", 3)  # another writer since the view
        assert refused(7, "b", 3)  # another leader
        assert refused(7, "a", 2)  # an older epoch
        assert not refused(7, "a", 3)
        with engine.connect() as holder, holder.begin():
            ledger.fence(holder, 7, "a", 3)
            with engine.connect() as other, other.begin(), pytest.raises(OperationalError):  # held to the commit
                other.execute(text("SELECT 1 FROM ledger_clock WHERE id = 1 FOR UPDATE NOWAIT"))
        with engine.begin() as conn:
            conn.execute(text("UPDATE ledger_clock SET leader_until = extract(epoch FROM clock_timestamp()) - 1"))
        assert refused(7, "a", 3)  # the lease ran out
    finally:
        engine.dispose()
