"""serving fleets: services, their revisions, and replica jobs

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07

`services`: a serving fleet of K replicas (`replicas`) of its current `revision`'s template; `spec` holds the rest
of its ServiceSpec (spread tier, rollout bounds, autoscaler, port). `service_revisions`: every template it had.
`jobs.service`: the service a job is a replica of ("" for a plain job), `jobs.serving` what the gang asked for
serving (roles, start order, ready probe, restart; for a replica its index and revision), `jobs.ready`/`ready_at`
its leader's readiness.
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "services",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), server_default="", nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.Column("autoscaler", sa.Text(), server_default="", nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("deleted_at", sa.Double(), nullable=True),
        sa.Column("version", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_services"),
    )
    op.create_table(
        "service_revisions",
        sa.Column("service", sa.String(length=64), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("template", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("cause", sa.Text(), server_default="", nullable=False),
        sa.ForeignKeyConstraint(
            ["service"], ["services.name"], name="fk_service_revisions_service_services", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("service", "revision", name="pk_service_revisions"),
    )
    op.add_column("jobs", sa.Column("service", sa.String(length=64), server_default="", nullable=False))
    op.add_column("jobs", sa.Column("serving", sa.JSON(), server_default="{}", nullable=False))
    op.add_column("jobs", sa.Column("ready", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.add_column("jobs", sa.Column("ready_at", sa.Double(), server_default="0", nullable=False))
    op.create_index("ix_jobs_service_state", "jobs", ["service", "state"])


def downgrade() -> None:
    op.drop_index("ix_jobs_service_state", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite rebuilds the table to drop a column
        batch.drop_column("ready_at")
        batch.drop_column("ready")
        batch.drop_column("serving")
        batch.drop_column("service")
    op.drop_table("service_revisions")
    op.drop_table("services")
