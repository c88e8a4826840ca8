"""Helpers for tests and benchmarks: multi-process gloo runs (multiproc) and training runs (runs)."""
