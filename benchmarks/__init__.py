"""Benchmark scripts; run them as `python benchmarks/<name>.py` (see benchmarks/README.md)."""
