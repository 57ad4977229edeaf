"""The API's routes, one module-level router per concern: health, sinks, the protocol's calls,
reads, operator actions (broker observations)."""
