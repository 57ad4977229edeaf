"""Engine creation, the database's clock, and schema migrations (Alembic, run programmatically)."""

from __future__ import annotations

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


def make_engine(url: str, pool_size: int = 20) -> Engine:
    """A pooled engine. Connections are kept open once opened (no overflow that closes them on
    return: a burst of executors' calls would otherwise open and close sessions continuously)."""
    return create_engine(sqlalchemy_url(url), pool_size=pool_size, max_overflow=0, pool_pre_ping=True,
                         pool_recycle=1800)


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


def schema_is_current(engine: Engine) -> bool:
    head = ScriptDirectory.from_config(alembic_config(engine.url.render_as_string(hide_password=False))).get_current_head()
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head
