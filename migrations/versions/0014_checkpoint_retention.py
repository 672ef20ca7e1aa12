"""checkpoint retention: jobs.keep_checkpoints and checkpoints.deleted_at

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

The checkpoint coordinator keeps the newest K complete committed checkpoints of each job (phalanx-checkpointd
--keep-checkpoints, default 3) and deletes the older ones and the shards of aborted checkpoints
(services/checkpoint_coordinator/retention.py). jobs.keep_checkpoints: the job's own K (JobSpec.keep_checkpoints;
0, the default of jobs submitted before this revision: the coordinator's). checkpoints.deleted_at: when the
coordinator deleted the checkpoint's files (NULL: not deleted); the row keeps its state (COMMITTED or ABORTED) and
its shards for the record, and a deleted checkpoint is never a restore point. The partial index over the
undeleted rows keeps the coordinator's periodic retention sweep from reading the deleted history.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


# Plain ALTER TABLE (no batch copy), as in 0011: SQLite adds and drops such columns in place.


def upgrade() -> None:
    op.add_column("jobs", sa.Column("keep_checkpoints", sa.Integer(), server_default="0", nullable=False))
    op.add_column("checkpoints", sa.Column("deleted_at", sa.Double(), nullable=True))
    op.create_index(
        "ix_checkpoints_undeleted",
        "checkpoints",
        ["job_id", "state"],
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_undeleted", table_name="checkpoints")
    op.drop_column("checkpoints", "deleted_at")
    op.drop_column("jobs", "keep_checkpoints")
