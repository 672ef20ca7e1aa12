"""checkpoint commit protocol: checkpoints.world_size/deadline_at/message and the checkpoint_requests table

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

A checkpoint is PENDING until every one of its world_size ranks reported a shard, then COMMITTED; it is ABORTED
after deadline_at. Rows recorded before this revision are all COMMITTED and keep world_size 0 (unknown).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("world_size", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("deadline_at", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("message", sa.Text(), server_default="", nullable=False))
    op.create_table(
        "checkpoint_requests",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoint_requests_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_checkpoint_requests")),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_requests")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("message")
        batch_op.drop_column("deadline_at")
        batch_op.drop_column("world_size")
