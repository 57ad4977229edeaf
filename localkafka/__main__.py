"""python -m localkafka start [--nodes 1|3] [--kafka-version V] [--transaction-version 1|2] [--port P]
                          [--dir D] [--foreground]
   python -m localkafka stop [--dir D] [--keep-data]
   python -m localkafka status [--dir D]
   python -m localkafka classpath {kafka,spark}

`start` runs a real Kafka (KRaft) on 127.0.0.1 from Kafka's own jars, resolved by Maven into ~/.m2
on first use, and prints its bootstrap servers. It keeps running after the command returns, until
`stop` (or, with --foreground, until Ctrl-C). Needs Java 17 and, the first time, Maven."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from .cluster import LocalKafka, LocalKafkaError
from .maven import KAFKA_VERSIONS, MavenError, default_kafka_version, kafka_classpath, spark_kafka_jars

DEFAULT_DIR = ".localkafka"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localkafka", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a cluster")
    start.add_argument("--nodes", type=int, default=1, choices=(1, 3), help="1 node, or 3 (replication 3, min ISR 2)")
    start.add_argument("--kafka-version", default=None,
                       help=f"default: the newest that resolves of {', '.join(KAFKA_VERSIONS)}")
    start.add_argument("--transaction-version", type=int, default=2, choices=(1, 2))
    start.add_argument("--port", type=int, default=9092, help="node 1's port; node N listens on PORT+N-1")
    start.add_argument("--dir", default=DEFAULT_DIR, help=f"data and logs (default {DEFAULT_DIR})")
    start.add_argument("--foreground", action="store_true", help="stay in the foreground; Ctrl-C stops the cluster")
    stop = sub.add_parser("stop", help="stop the cluster in --dir and remove its data")
    stop.add_argument("--dir", default=DEFAULT_DIR)
    stop.add_argument("--keep-data", action="store_true")
    status = sub.add_parser("status", help="which nodes of the cluster in --dir run")
    status.add_argument("--dir", default=DEFAULT_DIR)
    cp = sub.add_parser("classpath", help="resolve and print the jars of Kafka's server or of Spark's connector")
    cp.add_argument("what", choices=("kafka", "spark"))
    cp.add_argument("--kafka-version", default=None)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (LocalKafkaError, MavenError) as exc:
        print(f"localkafka: {exc}", file=sys.stderr)
        return 1


def _start(args: argparse.Namespace) -> int:
    ports = [args.port + i for i in range(args.nodes)]
    cluster = LocalKafka(args.dir, nodes=args.nodes, version=args.kafka_version,
                         transaction_version=args.transaction_version, ports=ports, detach=not args.foreground)
    print(f"starting Kafka ({args.nodes} node{'s' if args.nodes > 1 else ''}, transaction.version="
          f"{args.transaction_version}) in {cluster.directory} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    cluster.start()
    print(f"Kafka {cluster.version} is up in {time.monotonic() - started:.0f} s; logs in "
          f"{cluster.directory}/node-*/kafka.log", file=sys.stderr)
    print(cluster.bootstrap_servers, flush=True)
    if not args.foreground:
        print(f"stop it with: python -m localkafka stop --dir {args.dir}", file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(n.alive for n in cluster.nodes):
            time.sleep(0.5)
        print("localkafka: a node exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def _stop(args: argparse.Namespace) -> int:
    cluster = LocalKafka.attach(args.dir)
    cluster.stop(keep_data=args.keep_data)
    print(f"stopped the cluster in {cluster.directory}" + ("" if args.keep_data else " and removed its data"),
          file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = LocalKafka.attach(args.dir)
    states = cluster.status()
    for node, alive in states:
        print(f"node {node.node_id} 127.0.0.1:{node.port} pid {node.pid}: {'running' if alive else 'stopped'}")
    return 0 if all(alive for _, alive in states) else 3


def _classpath(args: argparse.Namespace) -> int:
    jars = kafka_classpath(args.kafka_version or default_kafka_version()) if args.what == "kafka" else spark_kafka_jars()
    print("\n".join(jars))
    return 0


COMMANDS = {"start": _start, "stop": _stop, "status": _status, "classpath": _classpath}

if __name__ == "__main__":
    sys.exit(main())
