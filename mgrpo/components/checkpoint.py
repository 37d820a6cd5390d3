"""The checkpointer: save, find the latest, restore all RL state, keep the last k.

A checkpoint is a folder `checkpoints/step_NNNNNN/` holding the Megatron distributed checkpoint of the
Megatron ranks (weights, optimizer moments, LR schedule: `megatron/`) and the driver's state
(`trainer_state.json`: step, weight version, counters, data position). It is published by rewriting
`checkpoints/latest` only after everything is on disk, so a run killed while saving resumes from the
previous one. Loading never unpickles arbitrary objects: JSON here, megatron's dist-checkpoint there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from mgrpo.config import ConfigError, TrainerConfig

log = logging.getLogger("mgrpo")

STATE_FILE = "trainer_state.json"
PENDING_FILE = "pending_rollouts.json"
"""Batches an asynchronous rollout had ready when the checkpoint was taken (replayed on resume)."""
COUNTERS = ("reward/failed", "reward/timeouts", "reward/masked_samples", "reward/dropped_groups",
            "reward/worker_restarts", "reward/model_restarts", "rollout/retries", "rollout/restarts",
            "rollout/stale_dropped", "rollout/auth_refused", "rollout/aborted", "dynamic_sampling/unfiltered_steps",
            "multi_turn/trajectory_retries")
"""Run-long counts of what went wrong and was handled; logged as `<name>_total`."""


@dataclass
class RunState:
    """Everything about a run's progress that lives on the driver."""

    step: int = 0
    """Training steps completed."""
    weight_version: int = 0
    """Weight syncs completed (the version the rollout engines hold)."""
    pending: Optional[dict] = field(default=None, repr=False, compare=False)
    """Asynchronous rollout's state restored from a checkpoint (`RolloutPipeline.state_dict`); not saved here."""
    counters: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def count(self, measured: dict) -> None:
        """Add the counts among `measured` (a step's or an evaluation's metrics: the keys in COUNTERS) to the
        run-long counters."""
        for key in COUNTERS:
            self.counters[key] += measured.get(key, 0)


SAVES_PER_RUN = 10
"""trainer.save_freq=null checkpoints this many times over a run (the last one at its end)."""
AUTO_KEEP = 2
"""...and keeps the newest this many (the published one and the one before it), unless max_ckpt_to_keep says:
a cadence nobody asked for must not fill the disk with ten copies of a large model."""


class Checkpointer:
    def __init__(self, run_dir: str, cfg: TrainerConfig, *, fingerprint: dict, total_steps: int):
        self.root = os.path.join(run_dir, "checkpoints")
        self.cfg = cfg
        """trainer.*: resume, save_freq, max_ckpt_to_keep."""
        self.fingerprint = fingerprint
        """The config's result-changing keys (components/run_folder.py), saved with every checkpoint."""
        self.total_steps = total_steps

    # --- cadence ------------------------------------------------------------------------------------
    def every(self, total_steps: int) -> int:
        """trainer.save_freq resolved: null = a tenth of the run (rounded up), so a kill loses at most that."""
        f = self.cfg.save_freq
        return f if f is not None else max(1, math.ceil(total_steps / SAVES_PER_RUN))

    def due(self, step: int, total_steps: int) -> bool:
        """A checkpoint after this step: every trainer.save_freq steps (the last one is `saves_at_end`'s)."""
        every = self.every(total_steps)
        return every > 0 and step % every == 0 and step < total_steps

    @property
    def saves_at_end(self) -> bool:
        """trainer.save_freq=0 writes no checkpoint at all; otherwise the run's end writes one."""
        return self.cfg.save_freq != 0

    # --- find ---------------------------------------------------------------------------------------
    def resume_dir(self) -> Optional[str]:
        """The checkpoint `trainer.resume` points at: the latest published one (auto, force), none
        (off, disable), or the given folder."""
        r = self.cfg.resume
        if r in ("off", "disable"):
            return None
        if r not in ("auto", "force"):
            return r
        return self.latest()

    def latest(self) -> Optional[str]:
        """The latest published checkpoint of this run folder, if any."""
        latest = os.path.join(self.root, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            return os.path.join(self.root, f.read().strip())

    @staticmethod
    def read_state(path: str) -> dict:
        file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(file):
            raise ConfigError(f"trainer.resume: {path} has no {STATE_FILE} (not a checkpoint of an mgrpo run)")
        with open(file) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{file}: not valid JSON ({e}); resume from an earlier checkpoint "
                                  "(trainer.resume=<its directory>) or start over (trainer.resume=disable)") from None

    # --- save ---------------------------------------------------------------------------------------
    def save(self, state: RunState, actor, train_data, observer=None, pending: Optional[dict] = None) -> str:
        t0 = time.monotonic()
        path = os.path.join(self.root, f"step_{state.step:06d}")
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
        actor.save_checkpoint(os.path.join(path, "megatron"))
        payload = {**{k: v for k, v in asdict(state).items() if k != "pending"},
                   "train_data": train_data.state_dict(), "total_steps": self.total_steps,
                   "config": self.fingerprint}
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(payload, f, indent=1)
        if pending is not None:
            with open(os.path.join(path, PENDING_FILE), "w") as f:
                json.dump(pending, f)
        if observer is not None:
            observer.flush()  # the records up to this step are on disk before the checkpoint is published
        tmp = os.path.join(self.root, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(self.root, "latest"))
        self._prune(keep=os.path.basename(path))
        log.info("checkpoint saved: %s (%.2f s)", path, time.monotonic() - t0)  # what the save cadence costs
        return path

    def _prune(self, keep: str) -> None:
        """Keep the newest `trainer.max_ckpt_to_keep` checkpoints (and always the published one); unset, the
        default cadence (save_freq null) keeps AUTO_KEEP, so that its ten saves do not hold ten copies."""
        k = self.cfg.max_ckpt_to_keep
        if k is None and self.cfg.save_freq is None:
            k = AUTO_KEEP
        if k is None or k <= 0:
            return
        steps = sorted(d for d in os.listdir(self.root) if re.fullmatch(r"step_\d+", d))
        for old in steps[:-k]:
            if old != keep:
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    # --- restore ------------------------------------------------------------------------------------
    def restore(self, path: str, actor, train_data) -> RunState:
        """Load weights and optimizer into the Megatron ranks and the data position; return the driver's
        state. (Bringing the rollout engines to the checkpoint's weights is the weight sync's job.)"""
        saved = self.read_state(path)
        actor.load_checkpoint(os.path.join(path, "megatron"))
        train_data.load_state_dict(saved["train_data"])
        state = RunState(step=int(saved["step"]), weight_version=int(saved["weight_version"]))
        counters = dict(saved.get("counters", {}))
        if "reward/timeout" in counters:  # its name before the failed-sample path (reward/timeouts)
            counters["reward/timeouts"] = counters.pop("reward/timeout")
        state.counters.update(counters)
        pending = os.path.join(path, PENDING_FILE)
        if os.path.isfile(pending):
            with open(pending) as f:
                state.pending = json.load(f)
        log.info("resumed from %s at step %d (weight version %d)", path, state.step, state.weight_version)
        return state
