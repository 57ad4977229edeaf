"""Postgres storage: schema, engine and migrations, reads and compare-and-set writes."""
