"""Where metrics go: TensorBoard event files, a JSONL copy (easy to grep and plot), and one console line
per step. Files are opened in append mode so a resumed run continues them instead of overwriting."""

from __future__ import annotations

import json
import math
import os
import re
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

# Multi-turn runs (rollout.multi_turn.enable) add these after `len`: what the model did with its tools.
MULTI_TURN_FIELDS = (
    ("turns", "multi_turn/turns_mean", "{:.2f}"),
    ("calls", "multi_turn/tool_calls_per_trajectory", "{:.2f}"),
    ("call_rate", "multi_turn/free_call_rate", "{:.2f}"),
    ("tool_err", "multi_turn/tool_errors", "{:.0f}"),
    ("failed", "multi_turn/failed", "{:.0f}"),
    ("cut", "multi_turn/tool_response_truncated", "{:.0f}"),
)

ETA_WINDOW = 5
"""The time left is paced by the last this-many steps (start-up, the first step's compilation and a slow
first weight sync would otherwise weigh on it for the whole run)."""


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

# The page added for multi-turn runs: what the model does with its tools, and what went wrong with them.
TB_MULTI_TURN = {"multi-turn": {
    "turns and tool calls per trajectory": ["Multiline", ["multi_turn/turns_mean",
                                                          "multi_turn/tool_calls_per_trajectory"]],
    "call rate (trajectories that call a tool, unforced)": ["Multiline", ["multi_turn/free_call_rate"]],
    "failures (trajectories, tool errors, timeouts, retries)": ["Multiline", [
        "multi_turn/failed", "multi_turn/tool_errors", "multi_turn/tool_timeouts", "multi_turn/env_errors",
        "multi_turn/env_timeouts", "multi_turn/trajectory_retries", r"sandbox/(error|timeout|limit)$"]],
    "truncations (tool replies, tokens cut, finish reasons)": ["Multiline", [
        "multi_turn/tool_response_truncated", "multi_turn/tokens_cut_after_call", r"multi_turn/finish/.*"]],
    "tool seconds": ["Multiline", [r"multi_turn/tool_seconds/.*"]],
}}


SERIES_DIR = "series"
"""Under tensorboard/: one run per series of a multi-line chart (series/<metric key>/). TensorBoard colours a
chart's lines by run and names the runs in its tooltip and run list: series written into one run share one
colour and have no name on the chart, so each series is also written into a run of its own, under the
chart's tag (what torch's SummaryWriter.add_scalars does for the same reason)."""


def chart_tag(title: str) -> str:
    """The tag a multi-line chart's series are written under in their own runs."""
    return "chart/" + re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def series_charts(layout: dict) -> tuple[dict, list[tuple[str, list]]]:
    """(the layout TensorBoard is given, [(chart tag, its series patterns)]): a chart that can show more than
    one series (several tags, or a pattern) reads its chart tag from the series' runs; one of a single tag
    stays as it is."""
    written, multi = {}, []
    for category, charts in layout.items():
        written[category] = {}
        for title, (kind, tags) in charts.items():
            if len(tags) > 1 or any(c in t for t in tags for c in "*+?[("):
                tag = chart_tag(title)
                multi.append((tag, [re.compile(t) for t in tags]))
                written[category][title] = [kind, [f"^{re.escape(tag)}$"]]
            else:
                written[category][title] = [kind, tags]
    return written, multi


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
                 stream=sys.stdout, resume_step: Optional[int] = None, config_text: Optional[str] = None,
                 multi_turn: bool = False):
        self.run_dir = run_dir
        self.fields = CONSOLE_FIELDS if not multi_turn else tuple(
            f for base in CONSOLE_FIELDS for f in ((base,) + MULTI_TURN_FIELDS if base[0] == "len" else (base,)))
        """The console line's columns: the tool columns come in for multi-turn runs."""
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self.stream = stream
        self._t0, self._first_step = time.monotonic(), (resume_step or 0)
        """Elapsed time counts from this attempt's start."""
        self._marks: list[tuple[int, float]] = [(self._first_step, self._t0)]
        """(step, when it was logged) of this attempt's last ETA_WINDOW + 1 steps: the pace of the time left."""
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
            layout, self._multi = series_charts({**TB_LAYOUT, **(TB_MULTI_TURN if multi_turn else {})})
            self._tb.add_custom_scalars(layout)
            self._series: dict = {}
            """metric key -> the EventWriter of its own run (opened at its first value)"""
            self._purge_step = None if resume_step is None else resume_step + 1
            if config_text:  # the Text tab: what this run (attempt) was started with
                self._tb.add_text("config", "```\n" + config_text + "\n```", resume_step or 0)

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
                    for tag, patterns in self._multi:
                        if any(p.fullmatch(k) for p in patterns):
                            self._series_writer(k).add_scalar(tag, v, step)
        if "console" in self.loggers:
            print(self.format_line(clean, step), file=self.stream, flush=True)

    def format_line(self, m: dict, step: int) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{label} {fmt.format(m[key])}" for label, key, fmt in self.fields if key in m]
        val = [f"{k} {v:.3f}" for k, v in m.items() if k.startswith("val/") and k.endswith("/score")]
        return " | ".join(parts + val + self._progress(step))

    def _progress(self, step: int) -> list[str]:
        """Elapsed wall time of this attempt and the time left at the pace of its last ETA_WINDOW steps."""
        now = time.monotonic()
        out = [f"elapsed {_clock(now - self._t0)}"]
        if step > self._marks[-1][0]:
            self._marks = (self._marks + [(step, now)])[-(ETA_WINDOW + 1):]
        (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
        if self.total_steps and s1 > s0 and step <= self.total_steps:
            out.append(f"eta {_clock((t1 - t0) / (s1 - s0) * (self.total_steps - step))}")
        return out

    def _series_writer(self, key: str):
        writer = self._series.get(key)
        if writer is None:
            from mgrpo.observe.tb_events import EventWriter

            writer = self._series[key] = EventWriter(os.path.join(self.run_dir, "tensorboard", SERIES_DIR, key),
                                                     purge_step=self._purge_step)
        return writer

    def _writers(self) -> list:
        return [] if self._tb is None else [self._tb, *self._series.values()]

    def flush(self) -> None:
        self._jsonl.flush()
        for w in self._writers():
            w.flush()

    def close(self) -> None:
        self.flush()
        self._jsonl.close()
        for w in self._writers():
            w.close()
