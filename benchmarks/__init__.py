"""One script per claim (docs/benchmarks.md). Run each from the repository root as a module:
``python -m benchmarks.NAME [flags]``; shared helpers are in :mod:`benchmarks.common`."""
