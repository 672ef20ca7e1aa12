"""partial GPUs: MIG instances and fractional shares in the ledger; GPU model filter on jobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

The no-double-booking index becomes unique on (gpu_id, unit): a whole GPU is unit -1, a MIG instance one row per
memory slice (0-7), and a `hold` row (unit -1) keeps whole-GPU jobs off a GPU that is split.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ACTIVE = sa.text("released_at IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpu_model", sa.String(length=128), server_default="", nullable=False))
        batch_op.add_column(sa.Column("mig_profile", sa.String(length=32), server_default="", nullable=False))
        batch_op.add_column(sa.Column("gpu_milli", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=8), server_default="gpu", nullable=False))
        batch_op.add_column(sa.Column("unit", sa.Integer(), server_default="-1", nullable=True))
        batch_op.add_column(sa.Column("profile", sa.String(length=32), server_default="", nullable=False))
        batch_op.add_column(sa.Column("gpu_milli", sa.Integer(), server_default="0", nullable=False))
    op.drop_index("uq_allocations_active_gpu", table_name="allocations", sqlite_where=ACTIVE, postgresql_where=ACTIVE)
    op.create_index(
        "uq_allocations_active_gpu",
        "allocations",
        ["gpu_id", "unit"],
        unique=True,
        sqlite_where=ACTIVE,
        postgresql_where=ACTIVE,
    )


def downgrade() -> None:
    op.drop_index("uq_allocations_active_gpu", table_name="allocations", sqlite_where=ACTIVE, postgresql_where=ACTIVE)
    op.execute("UPDATE allocations SET released_at = reserved_at WHERE kind <> 'gpu' AND released_at IS NULL")
    op.create_index(
        "uq_allocations_active_gpu",
        "allocations",
        ["gpu_id"],
        unique=True,
        sqlite_where=ACTIVE,
        postgresql_where=ACTIVE,
    )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_column("gpu_milli")
        batch_op.drop_column("profile")
        batch_op.drop_column("unit")
        batch_op.drop_column("kind")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("gpu_milli")
        batch_op.drop_column("mig_profile")
        batch_op.drop_column("gpu_model")
