"""the goodput read's index covers what it reads of the jobs not accounted (PostgreSQL)

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07

ix_jobs_unaccounted_submitted_at (revision 0016) holds only the jobs not accounted (the active ones), but the read
still went to the jobs' rows for their state, attempt, size, tenant and queue, and at 100,000 finished jobs the
planner judged a scan of the whole table as cheap as the index and its rows, then took the scan (~40 ms against
~4 ms: bench/goodput_read.py). On PostgreSQL the index now carries those columns (INCLUDE), so the read is an
index-only scan of the active jobs whatever the history. SQLite has no INCLUDE: its index is unchanged.
"""

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

NAME = "ix_jobs_unaccounted_submitted_at"
# What the goodput read takes of a job not accounted (db.models.GOODPUT_JOB_COLUMNS but the key, and `attempt`), as
# of this revision
COVERED = [
    "id",
    "state",
    "finished_at",
    "replicas",
    "gpus_per_replica",
    "mig_profile",
    "gpu_milli",
    "tenant",
    "queue",
    "attempt",
]


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.drop_index(NAME, table_name="jobs", postgresql_where="NOT accounted")
    op.create_index(NAME, "jobs", ["submitted_at"], postgresql_where="NOT accounted", postgresql_include=COVERED)


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.drop_index(NAME, table_name="jobs", postgresql_where="NOT accounted")
    op.create_index(NAME, "jobs", ["submitted_at"], postgresql_where="NOT accounted")
