"""Benchmarks (not tests): run with `python -m bench.<name>` from the repository root."""
