"""priority grants: a queue's highest priority, and who submitted a job

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03

`queues.max_priority`: the highest priority a job of the queue may ask for unless an admin submits it (0, the
"default" class, unless set: `phalanx quota set Q --max-priority P`). `jobs.by_admin`: an admin submitted the job
(every caller is one with authentication off): it may preempt other queues' jobs by priority; a job of a user may
only take back quota another queue borrowed from the cohort. Jobs of before count as an admin's (as they behaved).
`ledger_identity.rank_key`: the key that signs each attempt's rank credential (PHALANX_JOB_TOKEN), written once
(db.migrate.ensure_rank_key). `nodes.logs_port`: where the node's agent serves its ranks' logs (AgentLogs).
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("queues", sa.Column("max_priority", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("by_admin", sa.Boolean(), server_default=sa.true(), nullable=False))
    op.add_column("ledger_identity", sa.Column("rank_key", sa.String(length=64), server_default="", nullable=False))
    op.add_column("nodes", sa.Column("logs_port", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("nodes", "logs_port")
    op.drop_column("ledger_identity", "rank_key")
    op.drop_column("jobs", "by_admin")
    op.drop_column("queues", "max_priority")
