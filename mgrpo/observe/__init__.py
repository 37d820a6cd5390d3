"""Observe: metrics to TensorBoard / console / JSONL, trajectories, phase timers."""
