"""The exactly-once protocol as plain code without I/O: state machines, rules, invariants."""
