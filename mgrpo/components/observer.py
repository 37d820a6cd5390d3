"""The observer: the only writer of a run's record files.

It owns the tracker (TensorBoard, `metrics.jsonl`, one console line per step) and the trajectory file,
and it is what makes a resumed run append rather than repeat: records logged after the step a run
resumes from are dropped before anything new is written, so every step appears exactly once.
"""

from __future__ import annotations

import os
from typing import Optional

from mgrpo.config import MGRPOConfig
from mgrpo.experience import Experience
from mgrpo.observe.tracker import Tracker, truncate_jsonl
from mgrpo.observe.trajectories import TrajectoryWriter


class Observer:
    def __init__(self, run_dir: str, cfg: MGRPOConfig, *, total_steps: int, resume_step: Optional[int]):
        t = cfg.trainer
        self.tracker = Tracker(run_dir, t.logger, total_steps=total_steps, resume_step=resume_step)
        self.trajectories = None
        if t.log_trajectories:
            path = os.path.join(run_dir, "trajectories.jsonl")
            if resume_step is not None:
                truncate_jsonl(path, resume_step)
            self.trajectories = TrajectoryWriter(path)

    def log(self, metrics: dict, step: int) -> None:
        self.tracker.log(metrics, step=step)

    def write_trajectories(self, step: int, exp: Experience) -> None:
        """One line per sampled response, under the step its metrics are logged under."""
        if self.trajectories is None:
            return
        self.trajectories.write(step, [
            {"prompt": it.prompt_text, "response": text, "reward": rew, "score": sc,
             "advantage": adv[0] if adv else 0.0, "weight_version": ver, "finish_reason": fr,
             "data_source": it.data_source, "group": g}
            for it, text, rew, sc, adv, ver, fr, g in zip(exp.items, exp.response_texts, exp.rewards, exp.scores,
                                                           exp.advantages or [[]] * len(exp), exp.weight_versions,
                                                           exp.finish_reasons, exp.group_index)
        ])

    def flush(self) -> None:
        """Everything logged so far is on disk (called before a checkpoint is published)."""
        self.tracker.flush()
        if self.trajectories is not None:
            self.trajectories.flush()

    def close(self) -> None:
        self.tracker.close()
        if self.trajectories is not None:
            self.trajectories.close()
