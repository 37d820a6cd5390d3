"""The chaos harness, as the system tests use it (tests/test_chaos.py: the soak in short).

The harness itself is `benchmarks/jobs/chaos.py`: its own command (`python -m benchmarks.jobs.chaos`) runs the
long soak and writes benchmarks/results/chaos_cpu.json, which the README's Results table is rendered from. It
lives there, and this module imports it, so that the dependency points from the tests to what they test:
benchmark code never imports from tests/.
"""

from benchmarks.jobs.chaos import KINDS, Fault, Kind, make_schedule, soak_job

__all__ = ["KINDS", "Fault", "Kind", "make_schedule", "soak_job"]
