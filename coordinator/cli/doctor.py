"""`coordinator doctor`: checks of a deployment, each with a plain verdict (ok / warn / fail) and
the fix when it is not ok.

- database: reachable, and its schema at the migrations' head (Alembic current vs head);
- per sink -- every sink registered in the database, or one not registered yet given by
  `--bootstrap-servers/--prefix/--transaction-timeout-ms` -- the broker checks of the wire control
  plane (`KafkaWireControlPlane.check_broker`, the same as `POST /v1/sinks/{sink}/broker-check`):
  bootstrap reachable, advertised listeners reachable, transactions supported, the sink's
  transaction.timeout.ms against the broker's transaction.max.timeout.ms, no transactional id
  under the sink's prefix the coordinator does not know; a question the broker cannot answer
  (e.g. no KIP-664 ListTransactions) is a warning, not a failure;
- the sink's timeouts against the coordinator's own limits (COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS,
  COORDINATOR_RESTART_BUDGET_MS), and its commit margin against how late a decided commit may
  reach Kafka under the settings (configuration.CommitReach: I4);
- transactional-id prefix clashes between sinks (one prefix a prefix of another's: their pooled
  ids could collide);
- the history kept (its size on disk and its oldest unpruned batch) against the retention
  (COORDINATOR_HISTORY_RETENTION_HOURS): unset with over HISTORY_WARN_BYTES kept is a warning.

Nothing here changes anything. The checks are plain functions returning `Finding`s; cli.py prints them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine

from ..kafka.control_plane import BrokerCheck, KafkaTarget
from ..protocol import configuration as rules
from ..protocol import errors as e
from ..protocol.configuration import transactional_id_for
from ..settings import Settings
from ..store import history as store_history
from ..store import pool as store_pool
from ..store import sinks as store_sinks
from ..store.db import database_now, make_engine, schema_revision

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    scope: str  # "database", or "sink <name>"
    check: str
    verdict: str  # ok | warn | fail
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SinkUnderCheck:
    name: str
    bootstrap_servers: str
    transactional_id_prefix: str
    transaction_timeout_ms: int
    commit_margin_ms: int | None = None
    registered: bool = True


def from_broker_check(scope: str, c: BrokerCheck) -> Finding:
    verdict = OK if c.ok else (WARN if not c.verified else FAIL)
    return Finding(scope, c.name, verdict, c.verdict, c.fix)


# --- database ----------------------------------------------------------------------------------


def check_database(url: str | None) -> tuple[list[Finding], Engine | None]:
    """Reachability and migrations. Returns the engine when the schema is usable (at head)."""
    if url is None:
        return [Finding("database", "database", WARN,
                        "not checked: no --database-url given and COORDINATOR_DATABASE_URL is not set "
                        "(registered sinks cannot be listed either)",
                        "pass --database-url postgresql://user:pass@host:5432/db (the URL the service uses)")], None
    # a short connect timeout: an unreachable (black-holed) host is a verdict, not a hang
    engine = make_engine(url, pool_size=1, connect_timeout_s=10)
    where = engine.url.render_as_string(hide_password=True)
    try:
        with engine.connect() as conn:
            database_now(conn)
            revision = schema_revision(conn)
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the verdict
        engine.dispose()
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [Finding("database", "database", FAIL, f"cannot reach the database {where}: {first_line}",
                        "check COORDINATOR_DATABASE_URL (host, port, database name, user and password) and that "
                        "Postgres is running and accepts connections from this host")], None
    findings = [Finding("database", "database", OK, f"the database {where} answers")]
    current, head, known = revision.current, revision.head, revision.known
    if current == head:
        findings.append(Finding("database", "migrations", OK, f"the schema is at the migrations' head ({head})"))
        return findings, engine
    if current is None:
        detail = f"the database has no coordinator schema (migrations' head is {head})"
        fix = "run `coordinator migrate --database-url URL` (or start `coordinator serve`, which migrates)"
    elif current not in known:
        detail = (f"the schema is at revision {current}, which this version of the coordinator does not know "
                  f"(its head is {head}): the database was migrated by a newer version")
        fix = "run the coordinator version that migrated this database, or downgrade the schema with that version"
    else:
        detail = f"the schema is at revision {current}, behind the migrations' head {head}"
        fix = "run `coordinator migrate --database-url URL` before starting this version of the service"
    findings.append(Finding("database", "migrations", FAIL, detail, fix))
    engine.dispose()
    return findings, None


HISTORY_WARN_BYTES = 1 << 30  # kept history above which no retention is worth a warning


def check_history(engine: Engine, settings: Settings) -> Finding:
    """The batch history's size (attempts, leases, events: what pruning deletes) and age."""
    with engine.connect() as conn:
        kept_now = store_history.kept(conn)
    kept = (f"{kept_now.bytes / 2**20:,.0f} MB of history (attempts, leases, events) for {kept_now.batches:,} "
            "committed batch(es)" + (f", the oldest committed {kept_now.oldest:%Y-%m-%d %H:%M} UTC"
                                     if kept_now.oldest else ""))
    if settings.history_retention_hours:
        return Finding("database", "history", OK, f"{kept}; the recovery leader prunes batches older than "
                                                  f"{settings.history_retention_hours} h")
    if kept_now.bytes > HISTORY_WARN_BYTES:
        return Finding("database", "history", WARN, f"{kept}, and no retention is set: it grows with every batch",
                       "set COORDINATOR_HISTORY_RETENTION_HOURS (e.g. 720 for 30 days), or run "
                       "`coordinator prune-history --older-than 30d` (their checkpoint rows stay)")
    return Finding("database", "history", OK, f"{kept}; no retention is set (COORDINATOR_HISTORY_RETENTION_HOURS): "
                                              "the whole history is kept")


def registered_sinks(engine: Engine) -> list[SinkUnderCheck]:
    with engine.connect() as conn:
        found = store_sinks.live_sinks(conn)
    return [SinkUnderCheck(r.name, r.bootstrap_servers, r.transactional_id_prefix, r.transaction_timeout_ms,
                           r.commit_margin_ms) for r in found]


def known_ids(engine: Engine, sink_name: str) -> set[str]:
    """The ids of the sink's pool: the ids the coordinator created under its prefix."""
    with engine.connect() as conn:
        sink = store_sinks.sink_by_name(conn, sink_name, retired=True)
        size = store_pool.read(conn, sink.id).size
    return {transactional_id_for(sink.transactional_id_prefix, n) for n in range(size)}


# --- per sink ----------------------------------------------------------------------------------


def check_timeouts(sink: SinkUnderCheck, settings: Settings) -> Finding:
    scope = f"sink {sink.name}"
    limit = settings.broker_max_transaction_timeout_ms
    margin = sink.commit_margin_ms
    if margin is None:  # what registration would store
        margin = rules.default_commit_margin_ms(sink.transaction_timeout_ms, settings.commit_reach())
    try:  # the rules registration applies (coordinator/protocol/configuration.py)
        rules.validate_timeouts(sink.transaction_timeout_ms, margin, limit)
    except e.Invalid as exc:
        if exc.reason == "transaction_timeout_above_broker_max":
            return Finding(scope, "coordinator_timeouts", FAIL,
                           f"transaction_timeout_ms {sink.transaction_timeout_ms} exceeds the coordinator's limit "
                           f"COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS={limit}: the registration would be refused",
                           f"lower the sink's transaction_timeout_ms to at most {limit}, or raise "
                           "COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS to match the brokers' "
                           "transaction.max.timeout.ms")
        return Finding(scope, "coordinator_timeouts", FAIL, f"{exc.message}: the registration would be refused",
                       "use a commit margin of about a tenth of the transaction timeout")
    budget = settings.restart_budget_ms
    if sink.transaction_timeout_ms <= budget:
        return Finding(scope, "coordinator_timeouts", WARN,
                       f"transaction_timeout_ms {sink.transaction_timeout_ms} leaves no room for a driver restart "
                       f"(COORDINATOR_RESTART_BUDGET_MS={budget}): a batch decided just before a crash may time out "
                       "before it is resumed",
                       f"raise transaction_timeout_ms well above {budget} (and the brokers' transaction.max.timeout.ms)")
    return Finding(scope, "coordinator_timeouts", OK,
                   f"transaction_timeout_ms {sink.transaction_timeout_ms} is within the coordinator's limit {limit} "
                   f"and above the restart budget {budget}")


def check_commit_reach(sink: SinkUnderCheck, settings: Settings) -> Finding:
    """I4 needs the sink's commit margin above how late a decided commit may reach Kafka under
    these settings (registration refuses new sinks that miss it; this finds registered ones)."""
    scope = f"sink {sink.name}"
    reach = settings.commit_reach()
    margin = sink.commit_margin_ms
    if margin is None:
        margin = rules.default_commit_margin_ms(sink.transaction_timeout_ms, reach)
    try:
        rules.validate_commit_reach(sink.transaction_timeout_ms, margin, reach)
    except e.Invalid as exc:
        return Finding(scope, "commit_reach", FAIL, f"{exc.message} A decided commit of this sink can be lost "
                       "although the coordinator decided it in time.",
                       f"give the sink commit_margin_ms of at least {reach.total_ms + rules.REACH_SLACK_MS} and a "
                       "transaction timeout well above it (re-register under a new name, or change it in the "
                       "database), or lower COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS, COORDINATOR_KAFKA_RETRY_BUDGET_MS, "
                       "COORDINATOR_RECOVERY_LEADER_TTL_MS, COORDINATOR_RECOVERY_INTERVAL_MS")
    return Finding(scope, "commit_reach", OK, f"commit_margin_ms {margin} exceeds how late a decided commit may "
                   f"reach Kafka: {reach.describe()}")


def check_broker(sink: SinkUnderCheck, known: set[str], settings: Settings, request_timeout_ms: int) -> list[Finding]:
    from ..kafka.wire.control_plane import KafkaWireControlPlane

    options = settings.kafka_options()
    plane = KafkaWireControlPlane(request_timeout_ms=request_timeout_ms, retry_budget_ms=request_timeout_ms,
                                  client_config=options["client_config"], client_id="coordinator-doctor")
    try:
        target = KafkaTarget(sink.name, sink.bootstrap_servers, sink.transaction_timeout_ms)
        # pool ids are "<prefix>-<ordinal>": only ids under "<prefix>-" can collide (as check_sink_broker)
        checks = plane.check_broker(target, rules.transactional_id_stem(sink.transactional_id_prefix), known)
    finally:
        plane.close()
    return [from_broker_check(f"sink {sink.name}", c) for c in checks]


def check_prefixes(candidates: Iterable[SinkUnderCheck]) -> list[Finding]:
    """Two sinks whose prefixes are equal or one a prefix of the other can produce the same
    transactional id: each would abort and fence the other's transactions."""
    sinks = sorted(candidates, key=lambda s: s.name)
    findings = []
    for s in sinks:
        clashes = [o for o in sinks if o is not s
                   and rules.prefixes_clash(o.transactional_id_prefix, s.transactional_id_prefix)]
        scope = f"sink {s.name}"
        if clashes:
            shown = ", ".join(f"{o.name} ({o.transactional_id_prefix!r})" for o in clashes)
            findings.append(Finding(
                scope, "prefix_clash", FAIL,
                f"transactional_id_prefix {s.transactional_id_prefix!r} overlaps the prefix of {shown}: their pooled "
                "transactional ids can collide, and each sink would fence the other's transactions",
                "give every sink a prefix that is neither equal to nor a prefix of another sink's",
            ))
        else:
            findings.append(Finding(scope, "prefix_clash", OK,
                                    f"transactional_id_prefix {s.transactional_id_prefix!r} overlaps no other sink's"))
    return findings


# --- everything --------------------------------------------------------------------------------


def run(
    *,
    database_url: str | None,
    adhoc: SinkUnderCheck | None,
    only_sink: str | None = None,
    settings: Settings | None = None,
    request_timeout_ms: int = 5_000,
    check_kafka: bool = True,
) -> list[Finding]:
    """Every check. With `adhoc` (a sink not registered yet) its broker is checked and its prefix
    compared with the registered sinks'; otherwise every registered sink (or only `only_sink`)."""
    settings = settings or Settings()
    findings, engine = check_database(database_url)
    try:
        if engine is not None:
            findings.append(check_history(engine, settings))
        registered = registered_sinks(engine) if engine is not None else []
        if adhoc is not None:
            to_check = [adhoc]
        elif only_sink is not None:
            to_check = [s for s in registered if s.name == only_sink]
            if not to_check and engine is not None:
                findings.append(Finding(f"sink {only_sink}", "registered", FAIL,
                                        f"no sink named {only_sink!r} is registered in the database",
                                        "check the name (`coordinator sinks`), or register the sink first"))
            elif not to_check:  # the sink was asked for, and nothing of it could be checked
                findings.append(Finding(f"sink {only_sink}", "registered", FAIL,
                                        f"sink {only_sink!r} not checked: its registration cannot be read without "
                                        "the database",
                                        "pass a reachable --database-url (or COORDINATOR_DATABASE_URL), or check a "
                                        "sink not registered yet with --bootstrap-servers and --prefix"))
        else:
            to_check = registered
            if engine is not None and not registered:
                findings.append(Finding("sinks", "registered", WARN, "no sink is registered: no broker was checked",
                                        "register a sink, or pass --bootstrap-servers and --prefix to check one "
                                        "before registering it"))
        for sink in to_check:
            findings.append(check_timeouts(sink, settings))
            findings.append(check_commit_reach(sink, settings))
            if check_kafka:
                known = known_ids(engine, sink.name) if engine is not None and sink.registered else set()
                findings += check_broker(sink, known, settings, request_timeout_ms)
        checked = {f"sink {s.name}" for s in to_check}
        peers = [s for s in registered if adhoc is None or s.name != adhoc.name]
        everyone = ([adhoc] if adhoc is not None else []) + peers
        findings += [f for f in check_prefixes(everyone) if f.scope in checked]
    finally:
        if engine is not None:
            engine.dispose()
    return findings


def exit_code(findings: Iterable[Finding]) -> int:
    return 1 if any(f.verdict == FAIL for f in findings) else 0
