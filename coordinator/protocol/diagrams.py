"""The state machines of states.py drawn as Mermaid state diagrams, generated from their tables
(as h11's docs draw its state machine from its own table): docs/protocol.md holds this output
(tests/test_docs.py checks it), so a changed table shows up as a changed drawing.

    python -m coordinator.protocol.diagrams    # prints the diagrams for docs/protocol.md
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from .states import ATTEMPT_TRANSITIONS, CHECKPOINT_TRANSITIONS, INITIAL_STATES, LEASE_TRANSITIONS

MACHINES: dict[str, Mapping[StrEnum, frozenset[StrEnum]]] = {
    "checkpoint": CHECKPOINT_TRANSITIONS,  # type: ignore[dict-item]
    "attempt": ATTEMPT_TRANSITIONS,  # type: ignore[dict-item]
    "lease": LEASE_TRANSITIONS,  # type: ignore[dict-item]
}


def mermaid(table: Mapping[StrEnum, frozenset[StrEnum]]) -> str:
    """One state diagram: [*] leads to where an entity starts; end states lead to [*]."""
    lines = ["stateDiagram-v2", *(f"    [*] --> {s}" for s in INITIAL_STATES[type(next(iter(table)))])]
    for old, news in table.items():
        for new in sorted(news):
            lines.append(f"    {old} --> {new}")
        if not news:
            lines.append(f"    {old} --> [*]")
    return "\n".join(lines)


def document(machines: Mapping[str, Mapping[StrEnum, frozenset[StrEnum]]] = MACHINES) -> str:
    """Every diagram as the Markdown docs/protocol.md holds between its generated-diagram markers."""
    parts = []
    for name, table in machines.items():
        parts.append(f"{'An' if name[0] in 'aeiou' else 'A'} {name}:\n\n```mermaid\n{mermaid(table)}\n```")
    return "\n\n".join(parts)


if __name__ == "__main__":
    print(document())
