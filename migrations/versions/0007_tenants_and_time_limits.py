"""tenants and time limits: jobs.tenant (who submitted it; "" with authentication off) and jobs.time_limit
(declared seconds of runtime, 0: none; the scheduler stops a job at its limit and backfill plans with it), and
nodes.cordoned (an admin drained the node: it stays DRAINED when its agent registers again, until undrained)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("time_limit", sa.Double(), server_default="0", nullable=False))
        batch_op.create_index(batch_op.f("ix_jobs_tenant_submitted_at"), ["tenant", "submitted_at"], unique=False)
    # A plain ADD COLUMN (a batch would rebuild the table on SQLite, which its foreign keys refuse with data in it).
    op.add_column("nodes", sa.Column("cordoned", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("cordoned")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_tenant_submitted_at"))
        batch_op.drop_column("time_limit")
        batch_op.drop_column("tenant")
