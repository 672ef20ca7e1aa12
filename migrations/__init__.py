"""Alembic migrations for the Phalanx ledger (SQLite and PostgreSQL). Apply with `phalanx db upgrade --db URL`."""
