"""The command line: the `coordinator` command (command.py: serve, migrate, doctor and the
parser), the operator commands over HTTP (operator_commands.py), direct Kafka transactions
(kafka_commands.py), `coordinator doctor`'s checks (doctor.py) and `coordinator quickstart`
(quickstart.py). `python -m coordinator.cli` runs the same command."""


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point (pyproject: coordinator = "coordinator.cli:main"); imports
    the command only when run, so importing the package stays light."""
    from .command import main as run

    return run(argv)
