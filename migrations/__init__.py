"""Alembic migrations of the coordinator's schema (run by `coordinator migrate`)."""
