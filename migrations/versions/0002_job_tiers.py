"""job tiers: required_tier and preferred_tier on jobs

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NOT NULL with a server default: rows written before this revision read back as "" (no constraint).
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("required_tier", sa.String(length=64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("preferred_tier", sa.String(length=64), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("preferred_tier")
        batch_op.drop_column("required_tier")
