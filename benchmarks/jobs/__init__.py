"""The training job run end to end: learning, seeds, rollout paths, log-prob supports, the doctor, the chaos
soak (see benchmarks/__init__.py)."""
