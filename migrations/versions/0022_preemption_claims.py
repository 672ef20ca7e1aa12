"""preemption claims: a preemptor keeps what it freed

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-04

`claims`: a preemptor's claim on the capacity its victims free (phalanx.core.claims), from the ask until it runs,
leaves the queue or can no longer fit where it claimed: one row per claim made, `ended_at` NULL while it stands
(at most one standing claim per job: a partial unique index). `replicas` is where the preemptor goes (node, GPUs
and, for partial GPUs, the MIG instance or share), `victims` the gangs asked to stop for it; `queue` and `flavor`
the quota it keeps. Rows stay after the claim ends, with why (`end_reason`): the history the invariant checks read.
`job_attempts.preempted_by`: the gang an attempt was preempted for ("" otherwise).
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "claims",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("priority", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("queue", sa.String(length=64), server_default="", nullable=False),
        sa.Column("flavor", sa.String(length=64), server_default="", nullable=False),
        sa.Column("replicas", sa.JSON(), nullable=False),
        sa.Column("victims", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("end_reason", sa.Text(), server_default="", nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_claims_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_claims"),
    )
    op.create_index("ix_claims_job_id", "claims", ["job_id"])
    op.create_index(
        "uq_claims_standing_job",
        "claims",
        ["job_id"],
        unique=True,
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )
    op.add_column("job_attempts", sa.Column("preempted_by", sa.String(length=32), server_default="", nullable=False))


def downgrade() -> None:
    op.drop_column("job_attempts", "preempted_by")
    op.drop_index("uq_claims_standing_job", table_name="claims")
    op.drop_index("ix_claims_job_id", table_name="claims")
    op.drop_table("claims")
