"""host resources: CPUs and memory per replica, reserved with the GPUs

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03

`jobs.cpu_milli` / `jobs.memory`: what each replica asks of its node (thousandths of CPUs, bytes; 0 none).
`nodes.cpu_milli` / `nodes.memory`: what its agent reported at its last registration (0: not reported), and
`nodes.cpu_used` / `nodes.memory_used` what active allocations hold of them: a reservation raises them in a guarded
UPDATE (`... WHERE cpu_used + :c <= cpu_milli`), so two scheduler replicas racing can never overcommit a node, and
a release lowers them by what the allocation rows it releases carried. `allocations.cpu_milli` / `.memory`: a
replica's host resources, on one of its rows (its first GPU's, or its MIG instance's first slice, or its share).
`ix_allocations_active_node`: the active rows by node, for re-counting a node's held host resources.
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


# Plain ALTER TABLE (no batch copy): on SQLite a copied `nodes` table would take its GPU rows with it (ON DELETE
# CASCADE), as in 0011.


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cpu_milli", sa.Integer(), server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("memory", sa.BigInteger(), server_default="0", nullable=False))
    for column in ("cpu_milli", "cpu_used"):
        op.add_column("nodes", sa.Column(column, sa.Integer(), server_default="0", nullable=False))
    for column in ("memory", "memory_used"):
        op.add_column("nodes", sa.Column(column, sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("allocations", sa.Column("cpu_milli", sa.Integer(), server_default="0", nullable=False))
    op.add_column("allocations", sa.Column("memory", sa.BigInteger(), server_default="0", nullable=False))
    op.create_index(
        "ix_allocations_active_node",
        "allocations",
        ["node_id"],
        sqlite_where=sa.text("released_at IS NULL"),
        postgresql_where=sa.text("released_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_allocations_active_node", table_name="allocations")
    for table, column in (
        ("allocations", "memory"),
        ("allocations", "cpu_milli"),
        ("nodes", "memory_used"),
        ("nodes", "memory"),
        ("nodes", "cpu_used"),
        ("nodes", "cpu_milli"),
        ("jobs", "memory"),
        ("jobs", "cpu_milli"),
    ):
        op.drop_column(table, column)
