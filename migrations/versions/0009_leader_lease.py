"""scheduler leadership: ledger_clock.leader / leader_epoch / leader_until

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30

One scheduler replica leads (schedules and fires timers); it holds a lease on the clock row: `leader` (its replica
id), `leader_until` (unix seconds) and `leader_epoch`, a fencing token that goes up at every change of leader and
that every scheduling transaction checks under the row lock.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_clock", schema=None) as batch_op:
        batch_op.add_column(sa.Column("leader", sa.String(length=64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("leader_epoch", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("leader_until", sa.Double(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("ledger_clock", schema=None) as batch_op:
        batch_op.drop_column("leader_until")
        batch_op.drop_column("leader_epoch")
        batch_op.drop_column("leader")
