"""Persistence: SQLAlchemy models (the ledger), engine set-up and Alembic migrations."""
