"""checkpoint step agreement: the checkpoint_step_reports table, checkpoint_requests.target_attempt/target_step

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04

While a checkpoint request is outstanding, every rank of the job's current attempt reports the step it has just
completed with each poll (GetCheckpointRequest with a step): one row per (job, attempt, rank), replaced by the
rank's next report, naming the request it answers (requested_at). Once every rank 0..N-1 of the attempt has
reported for the request, the coordinator decides the step they all checkpoint at, max(reported) + 1, and keeps it
on the request (target_step, for target_attempt; NULL until decided). A commit that clears the request removes its
reports.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoint_step_reports",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("reported_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoint_step_reports_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank", name=op.f("pk_checkpoint_step_reports")),
    )
    with op.batch_alter_table("checkpoint_requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("target_attempt", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("target_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_requests", schema=None) as batch_op:
        batch_op.drop_column("target_step")
        batch_op.drop_column("target_attempt")
    op.drop_table("checkpoint_step_reports")
