"""finished job archive: job_archive, goodput_totals, and the indexes retention reads by

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03

Retention of finished jobs (services/scheduler/retention.py). A job that finished (SUCCEEDED, FAILED or CANCELLED)
more than the scheduler's --retain-finished ago (default 30 days) moves, in batches of one transaction each, from
`jobs` and every table that refers to it (allocations, job_attempts, ranks, checkpoints and their shards, checkpoint
requests, step reports and restores, and the assignments its nodes acknowledged) into one compact `job_archive`
row: what it was (name, tenant, queue, shape, priority), how it ended (state, times, exit code, message, attempts)
and its goodput figures as computed when it was archived, plus `detail` (JSON: its command, tiers, placement,
failure and preemption counts, and each attempt's outcome). `goodput_totals` sums the goodput figures and job counts of
every archived job by (tenant, queue, UTC day of submission; `day` is that day's start in unix seconds): the
scheduler's goodput reads these sums instead of loading the archived jobs. `phalanx db prune` deletes archive rows
(after exporting them); the sums keep their figures.

`jobs.accounted`: the job is finished and its goodput figures and count are in goodput_totals already. The
scheduler sets it in the transaction that finishes the job (services/scheduler/accounting.py account_finished), so
the goodput total reads only the jobs not accounted (the active ones) besides the sums; the archive moves an
accounted job without adding it again. Jobs that finished before this revision start unaccounted: the goodput read
counts them from `jobs` until the archive (or retention.account_backlog) adds them to the sums.

Indexes: ix_jobs_state_finished_at finds the jobs due for the archive; ix_assignments_job_id deletes a job's
assignments without scanning the outbox; ix_jobs_unaccounted_submitted_at (partial: only the jobs not accounted)
serves the goodput total's read of the active jobs, whatever the number of finished ones.
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# The partial index's predicate as each store's planner matches it against `accounted = false` (db.models.Job)
UNACCOUNTED_SQLITE = sa.text("accounted = 0")
UNACCOUNTED_PG = sa.text("NOT accounted")


def upgrade() -> None:
    op.create_table(
        "job_archive",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=253), nullable=False),
        sa.Column("tenant", sa.String(length=64), server_default="", nullable=False),
        sa.Column("queue", sa.String(length=64), server_default="default", nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("gpus_per_replica", sa.Integer(), nullable=False),
        sa.Column("mig_profile", sa.String(length=32), server_default="", nullable=False),
        sa.Column("gpu_milli", sa.Integer(), server_default="0", nullable=False),
        sa.Column("submitted_at", sa.Double(), nullable=False),
        sa.Column("started_at", sa.Double(), server_default="0", nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("exit_code", sa.Integer(), server_default="0", nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("allocated", sa.Double(), server_default="0", nullable=False),
        sa.Column("productive", sa.Double(), server_default="0", nullable=False),
        sa.Column("rollback", sa.Double(), server_default="0", nullable=False),
        sa.Column("restart", sa.Double(), server_default="0", nullable=False),
        sa.Column("waiting", sa.Double(), server_default="0", nullable=False),
        sa.Column("archived_at", sa.Double(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_archive")),
    )
    op.create_index(op.f("ix_job_archive_submitted_at_id"), "job_archive", ["submitted_at", "id"], unique=False)
    op.create_index(op.f("ix_job_archive_tenant_submitted_at"), "job_archive", ["tenant", "submitted_at"], unique=False)
    op.create_index(op.f("ix_job_archive_finished_at"), "job_archive", ["finished_at"], unique=False)
    op.create_table(
        "goodput_totals",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column("day", sa.BigInteger(), nullable=False),
        sa.Column("jobs", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("allocated", sa.Double(), server_default="0", nullable=False),
        sa.Column("productive", sa.Double(), server_default="0", nullable=False),
        sa.Column("rollback", sa.Double(), server_default="0", nullable=False),
        sa.Column("restart", sa.Double(), server_default="0", nullable=False),
        sa.Column("waiting", sa.Double(), server_default="0", nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "queue", "day", name=op.f("pk_goodput_totals")),
    )
    op.create_index(op.f("ix_goodput_totals_day"), "goodput_totals", ["day"], unique=False)
    op.create_index(op.f("ix_jobs_state_finished_at"), "jobs", ["state", "finished_at"], unique=False)
    op.create_index(op.f("ix_assignments_job_id"), "assignments", ["job_id"], unique=False)
    op.add_column("jobs", sa.Column("accounted", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.create_index(
        "ix_jobs_unaccounted_submitted_at",
        "jobs",
        ["submitted_at"],
        unique=False,
        sqlite_where=UNACCOUNTED_SQLITE,
        postgresql_where=UNACCOUNTED_PG,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_jobs_unaccounted_submitted_at",
        table_name="jobs",
        sqlite_where=UNACCOUNTED_SQLITE,
        postgresql_where=UNACCOUNTED_PG,
    )
    with op.batch_alter_table("jobs") as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column("accounted")
    op.drop_index(op.f("ix_assignments_job_id"), table_name="assignments")
    op.drop_index(op.f("ix_jobs_state_finished_at"), table_name="jobs")
    op.drop_index(op.f("ix_goodput_totals_day"), table_name="goodput_totals")
    op.drop_table("goodput_totals")
    op.drop_index(op.f("ix_job_archive_finished_at"), table_name="job_archive")
    op.drop_index(op.f("ix_job_archive_tenant_submitted_at"), table_name="job_archive")
    op.drop_index(op.f("ix_job_archive_submitted_at_id"), table_name="job_archive")
    op.drop_table("job_archive")
