"""ledger identity: ledger_identity (the cluster id)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

Every ledger has an identity, a random UUID written once when the database is created or upgraded to this revision
(`phalanx db upgrade`; an existing ledger upgraded to 0015 gets one too), kept by every later upgrade. The scheduler
returns it at registration (RegisterNodeResponse.cluster_id) and the node agent keeps it in its state directory: an
agent whose saved state belongs to another ledger (a new database, the same node name) kills the ranks of the old
ledger and starts clean instead of ignoring the new ledger's assignments. One row, id 1.
"""

import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "ledger_identity",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cluster_id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_identity")),
    )
    op.bulk_insert(table, [{"id": 1, "cluster_id": str(uuid.uuid4()), "created_at": time.time()}])


def downgrade() -> None:
    op.drop_table("ledger_identity")
