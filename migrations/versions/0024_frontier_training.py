"""frontier-scale training: segments, spares and elastic gangs (jobs.shape); job graphs (dependencies, arrays)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07

`jobs.shape`: how a gang is cut and kept ({"segment", "segment_tier", "spares_per_segment", "min_replicas"}; {} for
a plain gang). `jobs.after`: the jobs it waits for ([{"job_id", "condition"}]). `jobs.array`: on an array's parent
row, its spec and progress; `jobs.array_parent`/`array_task`: a task's array and index ("" and -1 otherwise), indexed
so an array's tasks are one range read.

`spare_pools` (a separate block below): the operator's spare pools (`phalanx pool create`), each with the nodes it
books per domain now.
"""

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Segments, spares, elastic gangs.
    op.add_column("jobs", sa.Column("shape", sa.JSON(), server_default="{}", nullable=False))
    # Job graphs.
    op.add_column("jobs", sa.Column("after", sa.JSON(), server_default="[]", nullable=False))
    op.add_column("jobs", sa.Column("array", sa.JSON(), server_default="{}", nullable=False))
    op.add_column("jobs", sa.Column("array_parent", sa.String(length=32), server_default="", nullable=False))
    op.add_column("jobs", sa.Column("array_task", sa.Integer(), server_default="-1", nullable=False))
    op.create_index("ix_jobs_array_parent_array_task", "jobs", ["array_parent", "array_task"])

    # ---- Operator-level spare pools (issue 34, item 2) ----------------------------------------------------------
    op.create_table(
        "spare_pools",
        sa.Column("name", sa.String(length=64), primary_key=True),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("per_domain", sa.Integer(), nullable=False),
        sa.Column("booked", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("spare_pools")
    op.drop_index("ix_jobs_array_parent_array_task", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column("array_task")
        batch.drop_column("array_parent")
        batch.drop_column("array")
        batch.drop_column("after")
        batch.drop_column("shape")
