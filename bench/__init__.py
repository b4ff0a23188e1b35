"""Benchmarks: `python -m bench.engine` (our engine vs transformers `generate`)."""
