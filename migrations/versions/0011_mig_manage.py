"""MIG mode switches by the scheduler (--mig-manage): nodes.mig_manage and the switch state of each GPU

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02

An agent started with --mig-manage registers so (nodes.mig_manage): the scheduler may then ask it to switch an idle
GPU's MIG mode (a SetMigMode assignment). Per GPU: the mode the agent reports pending until a GPU reset applies it
(gpus.mig_mode_pending, "" when none), the switch asked (mig_switch_to: ENABLED or DISABLED, "" none; when, and the
assignment's revision), its failure (mig_switch_error, and mig_retry_after: not asked again before then), and when
the mode last changed (mig_switched_at: a GPU is not switched back within the scheduler's --mig-switch-hold).
Nodes registered before this revision read mig_manage false until their agent registers again.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


# Plain ALTER TABLE (no batch copy): on SQLite a copied `nodes` table would take its GPU rows with it (ON DELETE
# CASCADE, foreign keys on), and SQLite adds and drops such columns in place.


def upgrade() -> None:
    op.add_column("nodes", sa.Column("mig_manage", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("gpus", sa.Column("mig_mode_pending", sa.String(length=16), server_default="", nullable=False))
    op.add_column("gpus", sa.Column("mig_switch_to", sa.String(length=16), server_default="", nullable=False))
    op.add_column("gpus", sa.Column("mig_switch_at", sa.Double(), server_default="0", nullable=False))
    op.add_column("gpus", sa.Column("mig_switch_revision", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("gpus", sa.Column("mig_switch_error", sa.Text(), server_default="", nullable=False))
    op.add_column("gpus", sa.Column("mig_retry_after", sa.Double(), server_default="0", nullable=False))
    op.add_column("gpus", sa.Column("mig_switched_at", sa.Double(), server_default="0", nullable=False))


def downgrade() -> None:
    for column in (
        "mig_switched_at",
        "mig_retry_after",
        "mig_switch_error",
        "mig_switch_revision",
        "mig_switch_at",
        "mig_switch_to",
        "mig_mode_pending",
    ):
        op.drop_column("gpus", column)
    op.drop_column("nodes", "mig_manage")
