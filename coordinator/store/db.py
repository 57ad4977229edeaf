"""Engine creation, the database's clock, and schema migrations (Alembic, run programmatically)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, text

_NOW = text("SELECT clock_timestamp()")


def sqlalchemy_url(url: str) -> str:
    """Accept plain postgres URLs and use the psycopg 3 driver for them."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain):]
    return url


def make_engine(url: str, pool_size: int = 20, connect_timeout_s: int | None = None) -> Engine:
    """A pooled engine. Connections are kept open once opened (no overflow that closes them on
    return: a burst of executors' calls would otherwise open and close sessions continuously).
    No ping before each use (a round trip per transaction): a connection the database dropped
    fails its first statement, SQLAlchemy discards the pool's connections, and the service runs
    the transaction again (ServiceContext)."""
    connect_args = {} if connect_timeout_s is None else {"connect_timeout": connect_timeout_s}
    return create_engine(sqlalchemy_url(url), pool_size=pool_size, max_overflow=0, pool_recycle=1800,
                         connect_args=connect_args)


def database_now(conn: Connection) -> datetime:
    """The database's clock (`clock_timestamp()`, not the transaction's start): one clock for
    every replica."""
    value = conn.execute(_NOW).scalar_one()
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(str(files("migrations")))))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


@dataclass(frozen=True)
class SchemaRevision:
    current: str | None  # the database's revision (None: no coordinator schema)
    head: str  # the migrations' newest
    known: set[str]  # every revision the migrations know


def schema_revision(conn: Connection) -> SchemaRevision:
    script = ScriptDirectory.from_config(alembic_config(conn.engine.url.render_as_string(hide_password=False)))
    return SchemaRevision(MigrationContext.configure(conn).get_current_revision(), script.get_current_head() or "",
                          {r.revision for r in script.walk_revisions()})


def schema_is_current(conn: Connection) -> bool:
    url = conn.engine.url.render_as_string(hide_password=False)
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    return MigrationContext.configure(conn).get_current_revision() == head
