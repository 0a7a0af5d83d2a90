"""Benchmarks of layered_cache against raw floors and the Python peers.

``python -m bench`` runs every scenario (``--quick`` for a smoke run) and writes
``bench/results/latest.json``, ``bench/results/REPORT.md`` and PNG plots. Each scenario
lives in its own module and returns a :class:`bench.report.Section`; every figure is the
median of repeats and is shown next to a floor measured in the same run.
"""
