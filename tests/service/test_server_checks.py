"""What the scheduler checks of its PostgreSQL server at start."""

from __future__ import annotations


def test_a_scheduler_on_a_postgresql_without_autovacuum_says_so(pg_url):
    """The ledger churns all day: on a server without autovacuum the operator is told at start (and not otherwise)."""
    import psycopg
    from structlog.testing import capture_logs

    from services.scheduler.service import SchedulerService
    from services.scheduler.settings import SchedulerSettings

    plain = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        (autovacuum,) = conn.execute("SHOW autovacuum").fetchone()
    service = SchedulerService(SchedulerSettings(db_url=pg_url))
    try:
        with capture_logs() as logs:
            service._check_server()
    finally:
        service.engine.dispose()
        service.read_engine.dispose()
    warned = [e for e in logs if e["event"] == "postgresql_autovacuum_off"]
    assert bool(warned) == (autovacuum != "on")
