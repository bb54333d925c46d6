"""Alembic environment and versions for the ledger schema (run them with ``ledger.migrate``)."""
