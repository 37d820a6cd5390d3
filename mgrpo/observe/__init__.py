"""Observe: metrics to TensorBoard / console / JSONL, trajectories, phase timers.

  tracker.py       where metrics go: TensorBoard, metrics.jsonl, one console line per step
  tb_events.py     TensorBoard event files with tensorboard's own classes, without torch
  metrics.py       metrics of one step's experience, under veRL's names
  trajectories.py  trajectories as JSONL, one line per sampled response
  timing.py        phase timers (timing_s/*)
  logs.py          how log lines look on every front door
  gc_pauses.py     the cycle collector frozen after start-up, its pauses measured
"""
