"""jobs page index: ix_jobs_submitted_at_id on jobs (submitted_at, id)

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04

ListJobs pages by key (services/scheduler/paging.py): newest first, by (submitted_at, id) descending, each page
the jobs after the previous page's last one. This index serves that order and the key bound, so that a page costs
O(page) however many jobs the ledger holds. ix_jobs_submitted_at stays (other readers use it).
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f("ix_jobs_submitted_at_id"), "jobs", ["submitted_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_submitted_at_id"), table_name="jobs")
