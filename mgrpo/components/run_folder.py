"""A run folder has one meaning: what `trainer.resume` finds there decides, before any process starts, whether this
invocation continues a run, starts one, or has nothing to do.

Every checkpoint stores the config's fingerprint: every key that can change what the run computes, with its value.
On `trainer.resume=auto`:
  - a checkpoint whose fingerprint equals the config's: continue from it (to a new end if only the length grew);
  - the run already finished at this length: say so and do nothing (no file is touched);
  - a fingerprint that differs: refuse (ConfigError, exit 2) naming each key with its old and new value, and
    the ways out;
  - records but no checkpoint (a first attempt stopped before it saved one): start over, with the previous
    attempt's files moved aside (kept) so that no step is ever logged twice.
`trainer.resume=disable` starts over the same way (`off` is read as disable); `trainer.resume=force` continues from the latest checkpoint with
the new values, listing what changed; `trainer.resume=<checkpoint dir>` continues from that checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from mgrpo.config import ConfigError, MGRPOConfig

log = logging.getLogger("mgrpo")

RESULT_NEUTRAL = (
    # logging and output
    "trainer.logger", "trainer.log_trajectories", "trainer.save_hf", "trainer.output_dir", "trainer.project_name",
    "trainer.experiment_name", "trainer.resume", "trainer.log_token_logprobs",
    # the mismatch guard only decides whether to stop (a user who hit it may resume with another bound)
    "trainer.max_logprob_diff", "trainer.logprob_diff_patience",
    # when to save and evaluate, and what evaluation does (it never touches the training streams)
    "trainer.save_freq", "trainer.max_ckpt_to_keep", "trainer.test_freq", "trainer.val_before_train", "evaluation.",
    # operations: where to connect, how long to wait, how to batch and ship what is computed anyway
    "trainer.ray_address", "trainer.allow_oversubscribe", "trainer.gpu_memory_gb", "trainer.cpus_per_worker",
    "trainer.gc_freeze",
    "rollout.health_check_interval_s", "rollout.health_check_timeout_s", "rollout.request_timeout_s",
    "rollout.max_retries", "rollout.update_weights_bucket_mb", "rollout.generate_chunk", "rollout.api_key",
    "reward.num_workers", "reward.isolate_builtin_rules", "reward.timeout_s",
    # where the actor's memory waits while the engines generate: the bytes come back as they left
    "actor.offload.",
)
"""Config keys (or key prefixes ending in '.') that cannot change what a run computes: they may differ between
the attempts of one run. Every other key is in the fingerprint."""

LENGTH = ("trainer.total_training_steps", "trainer.total_epochs")
"""How long the run is: a longer run continues an equal one; a shorter one is a difference."""

FILES = ("config.yaml", "metrics.jsonl", "trajectories.jsonl", "tensorboard", "checkpoints", "hf", "tokenizer", "init_hf", "logs")
"""What a run writes in its folder (moved aside together when a run starts over)."""


def flatten(obj, prefix: str = "") -> dict:
    """A config as {dotted key: JSON-able value}."""
    out = {}
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = [str(v) for v in value] if isinstance(value, list) else (
                {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else
                value if value is None or isinstance(value, (bool, int, float)) else str(value))
    return out


def _neutral(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESULT_NEUTRAL)


def fingerprint(cfg: MGRPOConfig) -> dict:
    """Every result-changing key of `cfg` with its value (the run's length included)."""
    return {k: v for k, v in flatten(cfg).items() if not _neutral(k)}


def differences(saved: dict, now: dict, *, ignore=()) -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for each key whose value differs (a key one side lacks counts)."""
    keys = sorted((set(saved) | set(now)) - set(ignore))
    missing = object()
    return [(k, saved.get(k), now.get(k)) for k in keys
            if saved.get(k, missing) != now.get(k, missing) and not _neutral(k)]


@dataclass
class Decision:
    resume_dir: Optional[str]
    """The checkpoint to continue from; None = start at step 0."""
    finished: bool = False
    """The run already reached this length: nothing to do."""
    message: str = ""
    """One line for the user about what was decided (empty for a plain fresh start)."""


class RunFolder:
    def __init__(self, run_dir: str, cfg: MGRPOConfig):
        self.run_dir, self.cfg = run_dir, cfg

    def has_records(self) -> bool:
        return any(os.path.exists(os.path.join(self.run_dir, f)) for f in FILES if f != "init_hf")

    def decide(self, latest: Optional[str], saved: Optional[dict], total_steps: int) -> Decision:
        """What to do given the latest published checkpoint (`latest`, its saved state `saved`) and the
        current config's step count. Raises ConfigError when the folder holds a different run."""
        mode = self.cfg.trainer.resume
        if mode in ("off", "disable"):
            return self._start_over("trainer.resume=disable")
        if mode not in ("auto", "force"):  # an explicit checkpoint directory
            self._warn_differences(saved, "trainer.resume=" + mode)
            return Decision(mode, message=f"resuming from {mode} (trainer.resume) at step {saved['step']}")
        if latest is None:
            if self.has_records():
                return self._start_over("the folder has records of an attempt that saved no checkpoint")
            return Decision(None)
        step = int(saved["step"])
        if "config" not in saved:  # written before checkpoints carried a fingerprint
            log.warning("checkpoint %s carries no config fingerprint; resuming without comparing configs", latest)
            return self._continue(latest, step, saved, total_steps)
        diffs = differences(saved["config"], fingerprint(self.cfg), ignore=LENGTH)
        if total_steps < step:
            diffs.append(("total steps", saved.get("total_steps", step), total_steps))
        if diffs and mode == "force":
            log.warning("trainer.resume=force: continuing from step %d with %s", step, _listed(diffs))
        elif diffs:
            raise ConfigError(self._refusal(latest, step, diffs))
        return self._continue(latest, step, saved, total_steps)

    # --- outcomes ---------------------------------------------------------------------------------
    def _continue(self, latest: str, step: int, saved: dict, total_steps: int) -> Decision:
        if step >= total_steps:
            return Decision(latest, finished=True, message=(
                f"{self.run_dir} already finished at step {step} of {total_steps}: nothing to do (a longer "
                "run continues it: raise trainer.total_training_steps)"))
        before = saved.get("total_steps")
        if before is not None and total_steps > before and step >= before:
            return Decision(latest, message=f"continuing the finished run from step {step} to the new end, "
                                            f"step {total_steps} (trainer.total_training_steps was {before})")
        return Decision(latest, message=f"resuming from {latest} at step {step} of {total_steps}")

    def _start_over(self, why: str) -> Decision:
        if not self.has_records():
            return Decision(None)
        aside = self.move_aside()
        return Decision(None, message=f"starting over ({why}): the previous attempt's files are kept in {aside}")

    def move_aside(self) -> str:
        """Move the run's files into <run_dir>/previous/<n>/ (n counts the attempts set aside) and return it."""
        root = os.path.join(self.run_dir, "previous")
        n = 1
        while os.path.exists(os.path.join(root, str(n))):
            n += 1
        dest = os.path.join(root, str(n))
        os.makedirs(dest)
        for f in FILES:
            src = os.path.join(self.run_dir, f)
            if os.path.exists(src):
                shutil.move(src, os.path.join(dest, f))
        return dest

    def _refusal(self, latest: str, step: int, diffs: list) -> str:
        lines = [f"{self.run_dir} holds another run: its checkpoint at step {step} ({latest}) was made with a "
                 f"different config:"]
        lines += [f"    {k}: {old!r} there, {new!r} now" for k, old, new in diffs]
        lines += ["  ways out: trainer.resume=disable (start over; the previous attempt's files are kept under "
                  f"{os.path.join(self.run_dir, 'previous')}), a new trainer.experiment_name (a folder of its own), "
                  "or trainer.resume=force (continue from that checkpoint with the new values)"]
        return "\n".join(lines)

    def _warn_differences(self, saved: Optional[dict], source: str) -> None:
        if saved and "config" in saved:
            diffs = differences(saved["config"], fingerprint(self.cfg), ignore=LENGTH)
            if diffs:
                log.warning("%s: the checkpoint was made with a different config: %s", source, _listed(diffs))


def _listed(diffs: list) -> str:
    return "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in diffs)
