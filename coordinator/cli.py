"""The `coordinator` command: `serve` runs the service, `migrate` applies schema migrations."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from .settings import Settings

log = logging.getLogger("coordinator")


def _admin_token_file(data_dir: Path) -> str:
    """The embedded default's admin token: generated once, kept readable only by its owner."""
    path = data_dir / "admin-token"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .store.db import migrate

    # uvicorn re-raises SIGTERM after its graceful shutdown. With the default action the process
    # would die without running atexit handlers, leaving the embedded Postgres running; exit
    # through SystemExit instead (status 143, as a shell reports for SIGTERM) so cleanup runs.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    settings = Settings()
    host = args.host or settings.host
    port = args.port or settings.port
    workers = args.workers or settings.workers
    url = settings.database_url
    if url is None:
        from . import embedded_postgres

        url = embedded_postgres.start(settings.data_dir)
        os.environ["COORDINATOR_DATABASE_URL"] = url
        if settings.admin_token is None:
            os.environ["COORDINATOR_ADMIN_TOKEN"] = _admin_token_file(settings.data_dir)
            log.warning("admin token generated in %s", (settings.data_dir / "admin-token").resolve())
        log.warning("using the embedded Postgres in %s (set COORDINATOR_DATABASE_URL for production)",
                    (settings.data_dir / "postgres").resolve())
    elif settings.admin_token is None:
        print("coordinator: COORDINATOR_ADMIN_TOKEN must be set when COORDINATOR_DATABASE_URL is", file=sys.stderr)
        return 2
    if settings.migrate_on_start:
        migrate(url)
    else:
        log.warning("COORDINATOR_MIGRATE_ON_START=false: not migrating; /readyz stays 503 until `coordinator migrate` ran")
    log.warning("serving on http://%s:%d (OpenAPI at /openapi.json)", host, port)
    uvicorn.run(
        "coordinator.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=settings.log_level,
    )
    return 0


def migrate_cmd(args: argparse.Namespace) -> int:
    from .store.db import downgrade, migrate

    url = args.database_url or Settings().database_url
    if url is None:
        print("coordinator migrate: give --database-url or set COORDINATOR_DATABASE_URL", file=sys.stderr)
        return 2
    if args.downgrade:
        downgrade(url, args.downgrade)
        print(f"downgraded to {args.downgrade}")
    else:
        migrate(url, args.revision)
        print(f"migrated to {args.revision}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the service (embedded Postgres when COORDINATOR_DATABASE_URL is unset)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int, help="uvicorn worker processes")
    p.set_defaults(func=serve)

    p = sub.add_parser("migrate", help="apply schema migrations to a database")
    p.add_argument("--database-url")
    p.add_argument("--revision", default="head", help="upgrade to this revision (default: head)")
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade to this revision instead (e.g. base)")
    p.set_defaults(func=migrate_cmd)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
