"""MIG mode and host-side launch failures: gpus.mig_mode, gpus.mig_instances, nodes.strikes, jobs.struck_nodes

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Each GPU's MIG mode as its agent registers it (ENABLED: it takes only MIG instances; DISABLED or UNSUPPORTED: only
whole-GPU jobs and shares) and the MIG instances present then (those Phalanx's agent did not make keep their memory
slices out of placement). GPUs registered before this revision read UNSUPPORTED until their agent registers again,
so they take no MIG instance. A rank whose host could not set it up (a retryable FAILED_TO_START: a MIG instance or
the MPS daemon) strikes the node: nodes.strikes counts them, and jobs.struck_nodes lists the nodes the job's next
placements avoid while it fits elsewhere.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.add_column(sa.Column("mig_mode", sa.String(length=16), server_default="UNSUPPORTED", nullable=False))
        batch_op.add_column(sa.Column("mig_instances", sa.JSON(), server_default="[]", nullable=False))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("strikes", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("struck_nodes", sa.JSON(), server_default="[]", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("struck_nodes")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("strikes")
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_column("mig_instances")
        batch_op.drop_column("mig_mode")
