"""moepager's benchmarks: one question each, run by `python -m benchmarks` (see __main__.py)."""
