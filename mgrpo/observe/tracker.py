"""Where metrics go: TensorBoard event files, a JSONL copy (easy to grep and plot), and one console line
per step. Files are opened in append mode so a resumed run continues them instead of overwriting."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable, Optional

# The one-line console summary: (label, metric key, format). Missing keys are left out.
CONSOLE_FIELDS = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("kl", "actor/kl_loss", "{:.4f}"),
    ("pg", "actor/pg_loss", "{:+.4f}"),
    ("ent", "actor/entropy", "{:.3f}"),
    ("len", "response_length/mean", "{:.2f}"),
    ("gen", "timing_s/gen", "{:.2f}s"),
    ("reward_t", "timing_s/reward", "{:.2f}s"),
    ("logp", "timing_s/old_logprob", "{:.2f}s"),
    ("ref", "timing_s/ref", "{:.2f}s"),
    ("update", "timing_s/update_actor", "{:.2f}s"),
    ("sync", "timing_s/update_weights", "{:.2f}s"),
    ("step", "timing_s/step", "{:.2f}s"),
)


class Tracker:
    def __init__(self, run_dir: str, loggers: Iterable[str], *, total_steps: Optional[int] = None,
                 stream=sys.stdout):
        self.run_dir = run_dir
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self.stream = stream
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if "console" in self.loggers:
            print(self.format_line(clean, step), file=self.stream, flush=True)

    def format_line(self, m: dict, step: int) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{label} {fmt.format(m[key])}" for label, key, fmt in CONSOLE_FIELDS if key in m]
        val = [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("val/") and k.endswith("/score")]
        return " | ".join(parts + val)

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.flush()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
