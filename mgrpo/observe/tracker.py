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
    ("reward_wait", "timing_s/reward_wait", "{:.2f}s"),  # of reward_t, what the forwards did not hide
    ("logp", "timing_s/old_logprob", "{:.2f}s"),
    ("ref", "timing_s/ref", "{:.2f}s"),
    ("update", "timing_s/update_actor", "{:.2f}s"),
    ("sync", "timing_s/update_weights", "{:.2f}s"),
    ("step", "timing_s/step", "{:.2f}s"),
    ("skipped", "actor/skipped_steps", "{:.0f}"),
)


# TensorBoard's Custom Scalars tab: the curves a GRPO run is read by, on one page (searching "reward" in the Scalars
# tab also finds the failure counters, which are flat at zero in a healthy run).
TB_LAYOUT = {"mgrpo": {
    "reward (train, validation)": ["Multiline", ["critic/score/mean", r"val/.*/score"]],
    "losses": ["Multiline", ["actor/pg_loss", "actor/kl_loss", "actor/loss"]],
    "entropy and KL to the old policy": ["Multiline", ["actor/entropy", "actor/ppo_kl"]],
    "response length": ["Multiline", ["response_length/mean"]],
    "engine vs trainer log-probs": ["Multiline", ["rollout/logprob_abs_diff"]],
    "step time": ["Multiline", [r"timing_s/.*"]],
}}


def truncate_jsonl(path: str, max_step: int) -> int:
    """Drop the records logged after `max_step` (a resumed run logs those steps again); return how many."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    keep = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= max_step]
    if len(keep) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(lines) - len(keep)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Tracker:
    def __init__(self, run_dir: str, loggers: Iterable[str], *, total_steps: Optional[int] = None,
                 stream=sys.stdout, resume_step: Optional[int] = None, config_text: Optional[str] = None):
        self.run_dir = run_dir
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self.stream = stream
        self._t0, self._first_step = time.monotonic(), (resume_step or 0)
        """Elapsed time and the time left count from this attempt's start and its steps."""
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None:
            truncate_jsonl(path, resume_step)
        self._jsonl = open(path, "a", buffering=1)
        self._tb = None
        if "tensorboard" in self.loggers:
            from mgrpo.observe.tb_events import EventWriter  # tensorboard's writer, no torch in the driver

            # purge_step hides events a previous attempt logged after the checkpoint we resume from.
            self._tb = EventWriter(os.path.join(run_dir, "tensorboard"),
                                   purge_step=None if resume_step is None else resume_step + 1)
            self._tb.add_custom_scalars(TB_LAYOUT)
            if config_text:  # the Text tab: what this run (attempt) was started with
                self._tb.add_text("config", "```\n" + config_text + "\n```", resume_step or 0)

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
        return " | ".join(parts + val + self._progress(step))

    def _progress(self, step: int) -> list[str]:
        """Elapsed wall time of this attempt and, at its mean pace so far, the time left."""
        elapsed = time.monotonic() - self._t0
        out = [f"elapsed {_clock(elapsed)}"]
        done = step - self._first_step
        if self.total_steps and done > 0 and step <= self.total_steps:
            out.append(f"eta {_clock(elapsed / done * (self.total_steps - step))}")
        return out

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.flush()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
