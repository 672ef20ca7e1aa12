"""ledger changes: what each scheduling transaction changed, for the other replicas

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02

Every scheduling transaction that bumps the ledger generation stores, under that generation, which rows of the
replicas' in-memory views it changed: job ids (job, allocation and rank rows), node and GPU ids, the new values
of the monotonic node columns (heartbeat, acked revision, assignment revision), whether a queue changed, and the
nodes given assignments. A replica that finds the generation moved reads the rows since its own and reloads only
those jobs and nodes, instead of the whole view; with a row missing (pruned after 10 minutes) it reloads whole.
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_changes",
        sa.Column("generation", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("replica", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("generation", name=op.f("pk_ledger_changes")),
    )
    op.create_index(op.f("ix_ledger_changes_at"), "ledger_changes", ["at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_ledger_changes_at"), table_name="ledger_changes")
    op.drop_table("ledger_changes")
