"""The end-to-end check of exactly-once output: the pure checker, the read_committed verifier and
the docker compose e2e suite (tests/e2e/test_e2e_compose.py)."""
