"""queues: per-queue GPU quotas with cohort borrowing and fair-share weights, and jobs.queue

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30

A queue has a nominal quota per GPU flavor (a GPU model, or "*" for any), in GPUs, and in MIG slices
(compute slices of the flavor's MIG instances), a borrowing limit per flavor, a cohort (queues of one cohort lend
each other their unused nominal quota) and a weight (its fair share among queues of equal priority). Jobs name
their queue; "default" is the queue of every job that names none, and has no quota (no limit) unless one is set.
jobs.flavor is the quota flavor its current attempt was admitted under (charged while it runs).
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "queues",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("cohort", sa.String(length=64), server_default="", nullable=False),
        sa.Column("weight", sa.Double(), server_default="1", nullable=False),
        sa.Column("quotas", sa.JSON(), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_queues")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("queue", sa.String(length=64), server_default="default", nullable=False))
        batch_op.add_column(sa.Column("flavor", sa.String(length=64), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("flavor")
        batch_op.drop_column("queue")
    op.drop_table("queues")
