"""Benchmark scripts (run as `python bench/<name>.py`); a package so tests can import them."""
