"""restore reports: the checkpoint_restores table

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03

What each rank of an attempt restored from, as phalanx.train.restore() reports it to the checkpoint coordinator
(ReportRestore): the checkpoint (checkpoint_id "" and step -1 when it started from step 0) and the newer committed
checkpoints it skipped because their files were missing or damaged (skipped, newest first, with the reason), and
the one-line message GetRestore shows. One row per (job, attempt, rank); a rank that reports again replaces it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoint_restores",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.String(length=32), server_default="", nullable=False),
        sa.Column("step", sa.BigInteger(), server_default="-1", nullable=False),
        sa.Column("skipped", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.Column("reported_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoint_restores_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank", name=op.f("pk_checkpoint_restores")),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_restores")
