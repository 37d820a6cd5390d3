"""mgrpo against others on the same workload: TRL's GRPOTrainer, Liger's fused loss (see
benchmarks/__init__.py)."""
