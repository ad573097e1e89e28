"""The vendored Triton files are the peers' code, run by tests/peers/test_*.py as child
processes (or imported), never collected as our tests (``*_test.py`` would match)."""

collect_ignore_glob = ["examples/*", "qa/*"]
