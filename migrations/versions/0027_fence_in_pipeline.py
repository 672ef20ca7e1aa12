"""the leader's fence checked by the server, in the closing pipeline (PostgreSQL)

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-08

A scheduling cycle took the clock row's lock first (ledger.begin_cycle: BEGIN and SELECT ... FOR UPDATE), waiting
for the answer before deciding anything: one round trip before the decision, one more for the closing writes and
the COMMIT. A leader whose view is its own (no other writer since its last commit) and whose lease is far from
running out may skip that wait: it decides on the view it holds and sends `SELECT phalanx_fence(generation,
replica, epoch)` first in its closing pipeline. The function takes the same row lock, and raises (SQLSTATE 40001,
serialization_failure) unless the clock row still holds the generation the view was built on and this replica's
lease, unexpired by the database's clock; the writes after it and the COMMIT then roll back. The single-writer
rule is checked inside the transaction that writes, under the lock it holds to the commit, as before
(services/scheduler/ledger/lease.py, fence). SQLite keeps taking the lock first (BEGIN IMMEDIATE).
"""

from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION phalanx_fence(expected_generation bigint, replica text, expected_epoch bigint)
        RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            clock ledger_clock%ROWTYPE;
        BEGIN
            SELECT * INTO clock FROM ledger_clock WHERE id = 1 FOR UPDATE;
            IF clock.generation IS DISTINCT FROM expected_generation THEN
                RAISE EXCEPTION 'fence: the ledger moved to generation % since this replica''s view (%)',
                    clock.generation, expected_generation USING ERRCODE = 'serialization_failure';
            END IF;
            IF clock.leader IS DISTINCT FROM replica OR clock.leader_epoch IS DISTINCT FROM expected_epoch
               OR clock.leader_until <= extract(epoch FROM clock_timestamp()) THEN
                RAISE EXCEPTION 'fence: % no longer holds the lease of epoch % (leader %, epoch %)',
                    replica, expected_epoch, clock.leader, clock.leader_epoch USING ERRCODE = 'serialization_failure';
            END IF;
        END
        $$
        """
    )


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS phalanx_fence(bigint, text, bigint)")
