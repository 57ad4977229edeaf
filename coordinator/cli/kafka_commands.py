"""`coordinator kafka abort-transaction|commit-transaction`: act on one Kafka transaction directly,
outside the coordinator's bookkeeping (FLINK-39218), through the wire control plane."""

from __future__ import annotations

import argparse
import sys


def _confirm(args: argparse.Namespace, action: str) -> bool:
    if args.yes:
        return True
    print(f"This will {action} on {args.bootstrap_servers}, outside the coordinator's bookkeeping: the coordinator "
          "does not learn of it. Use it only for a transaction no running coordinator owns.", file=sys.stderr)
    if not sys.stdin.isatty():
        print("coordinator kafka: not confirmed (stdin is not a terminal); pass --yes to proceed", file=sys.stderr)
        return False
    return input("Type 'yes' to proceed: ").strip() == "yes"


FORCE_COMMIT_WHY = (
    "coordinator kafka commit-transaction: refused without --force. Committing a transaction the coordinator "
    "did not decide makes its records visible whatever the bookkeeping says: a losing task attempt's copy of a "
    "partition lands next to the winner's (duplicates), and an attempt that was never decided shows a partial "
    "batch that Spark will write again. Use it only when no coordinator can finish the batch and its record names "
    "this transaction a decided winner (`coordinator checkpoints SINK`, the batch's COMMITTING state); otherwise "
    "let `coordinator commit SINK BATCH` (resume) do it.")


def kafka_cmd(args: argparse.Namespace) -> int:
    from ..kafka.control_plane import ControlPlaneError, KafkaTarget, PreparedTransaction
    from ..kafka.wire.control_plane import KafkaWireControlPlane

    tid = args.transactional_id
    if args.kafka_command == "abort-transaction":
        action = f"abort whatever transaction {tid!r} holds (InitProducerId fences its producer)"
    else:
        action = f"commit transaction {tid!r} of producer id {args.producer_id} epoch {args.epoch} (EndTxn)"
        if not args.force:
            print(FORCE_COMMIT_WHY, file=sys.stderr)
            return 2
    if not _confirm(args, action):
        return 2
    from ..settings import Settings

    settings = Settings()
    plane = KafkaWireControlPlane(request_timeout_ms=args.timeout_ms, retry_budget_ms=args.timeout_ms * 3,
                                  client_config=settings.kafka_options()["client_config"], client_id="coordinator-cli")
    target = KafkaTarget("cli", args.bootstrap_servers, args.transaction_timeout_ms)
    try:
        if args.kafka_command == "abort-transaction":
            plane.abort(target, tid)
            print(f"aborted: {tid!r} is fenced and holds no open transaction")
        else:
            plane.commit(target, PreparedTransaction(tid, args.producer_id, args.epoch))
            print(f"committed: transaction {tid!r} (producer id {args.producer_id}, epoch {args.epoch})")
    except ControlPlaneError as exc:
        if exc.retriable:
            kind = "retriable"
        elif exc.transaction_gone or exc.code == "invalid_producer_id":  # (the latter: nothing was sent)
            kind = "refused for good"
        else:  # e.g. UNKNOWN_SERVER_ERROR, an authorization failure: the transaction may still commit
            kind = "not final: retry later"
        print(f"coordinator kafka {args.kafka_command}: {exc.code} ({kind}): {exc}", file=sys.stderr)
        return 1
    finally:
        plane.close()
    return 0
