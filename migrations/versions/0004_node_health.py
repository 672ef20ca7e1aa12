"""node and GPU health: nodes.health, nodes.health_detail, and the node_events table

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

Health comes with the agents' heartbeats (services/node_agent/health.py) and is written only when it changes.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("health", sa.String(length=16), server_default="HEALTHY", nullable=False))
        batch_op.add_column(sa.Column("health_detail", sa.JSON(), server_default="{}", nullable=False))
    op.create_table(
        "node_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("code", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_node_events_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_events")),
    )
    op.create_index(op.f("ix_node_events_node_id_at"), "node_events", ["node_id", "at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_node_events_node_id_at"), table_name="node_events")
    op.drop_table("node_events")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("health_detail")
        batch_op.drop_column("health")
