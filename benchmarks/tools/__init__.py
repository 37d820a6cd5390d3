"""What the benchmarks share or feed: process-tree measurement, the README renderer, the test suite's counts
(see benchmarks/__init__.py)."""
