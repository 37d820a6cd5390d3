"""GPU checks in one command (`python -m benchmarks.gpu.run`); see README.md in this folder."""
