"""preemption, retries and goodput: jobs.failures/preemptions/not_before/preempted_by/preempt_deadline/
max_restarts, the job_attempts table and the service_endpoints table

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30

`failures` counts attempts torn down by a failure (the retry limit counts these; a preemption does not), and
`not_before` is the end of a requeued job's retry backoff. A victim of a preemption keeps state RUNNING with
`preempted_by` (the preemptor's id) and `preempt_deadline` (when it is stopped if its checkpoint is not in).
`max_restarts`: how many times a rank exiting non-zero requeues the gang (0: it fails the job).
`job_attempts` is one row per launch of a gang: the times and the committed step goodput accounting needs.
`service_endpoints`: where services say they can be reached (the checkpoint coordinator, for the scheduler).
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("preemptions", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("not_before", sa.Double(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("preempted_by", sa.String(length=32), server_default="", nullable=False))
        batch_op.add_column(sa.Column("preempt_deadline", sa.Double(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("max_restarts", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "job_attempts",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Double(), nullable=False),
        sa.Column("reserved_at", sa.Double(), nullable=False),
        sa.Column("running_at", sa.Double(), nullable=True),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("outcome", sa.String(length=16), server_default="", nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("restored_step", sa.BigInteger(), server_default="-1", nullable=False),
        sa.Column("committed_step", sa.BigInteger(), server_default="-1", nullable=False),
        sa.Column("kept_until", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_attempts_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "attempt", name=op.f("pk_job_attempts")),
    )
    op.create_index(op.f("ix_job_attempts_ended_at"), "job_attempts", ["ended_at"], unique=False)
    op.create_table(
        "service_endpoints",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_service_endpoints")),
    )


def downgrade() -> None:
    op.drop_table("service_endpoints")
    op.drop_index(op.f("ix_job_attempts_ended_at"), table_name="job_attempts")
    op.drop_table("job_attempts")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("max_restarts")
        batch_op.drop_column("preempt_deadline")
        batch_op.drop_column("preempted_by")
        batch_op.drop_column("not_before")
        batch_op.drop_column("preemptions")
        batch_op.drop_column("failures")
