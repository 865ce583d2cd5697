"""Benchmarks: each ``bench_*.py`` module has ``run() -> list[dict]``; ``make bench`` runs them all."""
