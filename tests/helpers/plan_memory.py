"""The memory planner against measurement: the CPU benchmark's measured peak per rank, and the tolerance the
estimate must meet."""

from __future__ import annotations

import os
import sys
import tempfile


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _measure(case: str) -> list[dict]:
    sys.path.insert(0, BENCH)  # also for the spawned ranks, which unpickle the benchmark's rank function
    try:
        import plan_memory_cpu

        with tempfile.TemporaryDirectory() as work:
            return plan_memory_cpu.measure(case, work, malloc="mmap")
    finally:
        sys.path.remove(BENCH)


def _check(rows):
    for r in rows:
        assert abs(r["estimate_over_measured"] - 1) <= 0.25, r  # the estimate within 25% of the measured peak
