"""a compare-and-set on a job that finds its row changed fails in the server (PostgreSQL)

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07

The scheduling cycle writes every job it changed compare-and-set on the version its view read
(services/scheduler/ledger/jobs.py flush_job_updates). Checking each update's row count in the scheduler costs a
round trip before the commit may be sent. `phalanx_expect_updated(changed, job)` raises (SQLSTATE 40001,
serialization_failure) unless exactly one row changed, so the update itself fails when the row moved, and the
updates, the cycle's closing writes and its COMMIT travel in one pipeline: a refused update aborts the
transaction, and the COMMIT that follows it rolls back. SQLite keeps checking the row counts.
"""

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION phalanx_expect_updated(changed bigint, job text) RETURNS void
        LANGUAGE plpgsql AS $$
        BEGIN
            IF changed <> 1 THEN
                RAISE EXCEPTION 'job % changed in the ledger since the view read it', job
                    USING ERRCODE = 'serialization_failure';
            END IF;
        END
        $$
        """
    )


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS phalanx_expect_updated(bigint, text)")
