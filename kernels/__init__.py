"""Fused chunked GRPO log-prob / entropy / KL / loss kernels (import name: mgrpo_kernels)."""
