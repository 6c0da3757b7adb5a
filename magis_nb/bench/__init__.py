"""Benchmarks: `python -m magis_nb.bench <command>` prints numbers (and writes JSON)."""
