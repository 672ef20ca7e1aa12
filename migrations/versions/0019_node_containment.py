"""node containment: how each node's agent contains its ranks

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03

`nodes.containment` is what the agent said at its last registration: "cgroup-v2", "cgroup-v1" or "process-group"
(services/node_agent/containment.py); empty for an agent of before it. `phalanx nodes` shows it.
`nodes.confirms_release`: the agent reports when an ended attempt's processes on the node are gone; until then the
attempt's whole-GPU allocations there stay active (the GPUs are releasing, not free). `nodes.rank_port_low/high`:
the agent's --rank-port-range, where MASTER_PORT is chosen for attempts whose rank 0 runs on the node.
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


# Plain ALTER TABLE (no batch copy): on SQLite a copied `nodes` table would take its GPU rows with it (ON DELETE
# CASCADE), as in 0011.


def upgrade() -> None:
    op.add_column("nodes", sa.Column("containment", sa.String(length=16), server_default="", nullable=False))
    op.add_column("nodes", sa.Column("confirms_release", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("nodes", sa.Column("rank_port_low", sa.Integer(), server_default="0", nullable=False))
    op.add_column("nodes", sa.Column("rank_port_high", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("nodes", "rank_port_high")
    op.drop_column("nodes", "rank_port_low")
    op.drop_column("nodes", "confirms_release")
    op.drop_column("nodes", "containment")
