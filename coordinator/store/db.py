"""Engine creation and schema migrations (Alembic, run programmatically)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine

from . import driver_sql
from .connections import RECYCLE_S


def sqlalchemy_url(url: str) -> str:
    """Accept plain postgres URLs and use the psycopg 3 driver for them."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain):]
    return url


def make_engine(url: str, pool_size: int = 20) -> Engine:
    """Up to 2 x pool_size connections, as before, but all kept open once opened: overflow
    connections were closed on return, so a burst of concurrent calls (64 executors leasing at
    once) opened and closed Postgres sessions continuously (~20 new backends/s measured)."""
    engine = create_engine(
        sqlalchemy_url(url),
        pool_size=2 * pool_size,
        max_overflow=0,
        # no pre-ping (a round trip per checkout, ~10% of a protocol call): the service retries a
        # transaction whose pooled connection turns out to be dead instead
        pool_pre_ping=False,
        pool_recycle=RECYCLE_S,
    )
    # psycopg's DEALLOCATE ALL after a rollback drops the hot path's prepared statements too; and
    # no statement may follow one that committed its transaction
    driver_sql.hook_engine(engine)
    return engine


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
