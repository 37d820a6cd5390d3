"""The log-prob mismatch guard: a run whose rollout engine and trainer disagree stops, naming the doctor.

The engine's log-prob of each sampled token and the trainer's recomputation of it (same weights, same tokens)
should agree to rounding; `rollout/logprob_abs_diff` is their mean absolute difference per token over a step.
When agreement breaks (a bf16 engine against an fp32 trainer is expected; a wrong RoPE theta, a stale or
wrongly converted layer, a kernel bug are not) the importance ratios drift and the run collapses slowly.
slime asserts a bound on the same number in its CI (`--ci-train-rollout-logprob-abs-diff-threshold`, 0.1 by
default); this is that check in users' runs: `trainer.logprob_diff_patience` consecutive steps above
`trainer.max_logprob_diff` stop the run with a message naming `mgrpo-doctor run <run folder>`.

Only samples made with the weights the trainer computed the step's log-probs with are judged: with
asynchronous rollout an older sample differs by the policy's own change, which is no mismatch. In
synchronous rollout (the default) that is every sample, and the value is `rollout/logprob_abs_diff`.
"""

from __future__ import annotations

import math

from mgrpo.config import InputError, MGRPOConfig
from mgrpo.config.schema import MAX_LOGPROB_DIFF_DEFAULTS

# trainer.max_logprob_diff=null is MAX_LOGPROB_DIFF_DEFAULTS[actor.dtype] (config/schema.py). fp32: the default CPU
# job measures 0.9e-7 to 2.1e-7 per step (and 5.5e-6 for its worst token) over 150 steps
# (benchmarks/results/doctor_main_job_cpu.json), while the faults the doctor's tests inject reach 1e-2 and
# more: 1e-3 is far from both. bf16: slime's CI bound (--ci-train-rollout-logprob-abs-diff-threshold, default
# 0.1); bf16 runs report 0.016-0.03 mean per token between bf16 engines (SGLang, vLLM) and bf16 trainers, and
# bitwise-aligned kernels bring it under 1e-6, which is when a user sets a tighter bound.


class LogprobMismatch(InputError):
    """The engine's and the trainer's log-probs of the same tokens disagreed beyond trainer.max_logprob_diff for
    trainer.logprob_diff_patience consecutive steps. Ends the run like bad input: one message, exit 2."""


def logprob_diff_bound(cfg: MGRPOConfig) -> float:
    """trainer.max_logprob_diff, or its default for actor.dtype (resolved: fp32 or bf16)."""
    t = cfg.trainer
    if t.max_logprob_diff is not None:
        return t.max_logprob_diff
    return MAX_LOGPROB_DIFF_DEFAULTS.get(str(cfg.actor.dtype), MAX_LOGPROB_DIFF_DEFAULTS["bf16"])


class LogprobGuard:
    def __init__(self, cfg: MGRPOConfig, run_dir: str):
        self.bound = logprob_diff_bound(cfg)
        self.default = cfg.trainer.max_logprob_diff is None
        self.dtype = str(cfg.actor.dtype)
        self.patience = cfg.trainer.logprob_diff_patience
        self.run_dir = run_dir
        self.over: list[float] = []
        """The judged values of the current run of consecutive steps above the bound."""

    @property
    def active(self) -> bool:
        return self.patience > 0

    def measure(self, exp, version: int) -> dict:
        """Judge one step: `exp`'s samples made with weight `version` (the weights its trainer log-probs were
        computed with). Returns `rollout/logprob_guard_diff` (the value judged), `rollout/logprob_guard_streak`
        (consecutive steps above the bound) or, when no sample was made with those weights (asynchronous
        rollout), `rollout/logprob_guard_unchecked` = 1 and the streak as it was."""
        if not self.active:
            return {}
        sampled = exp.sampled_mask or [None] * len(exp)  # multi-turn context tokens have no engine log-prob
        diffs = [abs(a - b) for ro, tr, v, m in zip(exp.rollout_logprobs, exp.old_logprobs or [], exp.weight_versions,
                                                     sampled)
                 if v == version for k, (a, b) in enumerate(zip(ro, tr)) if m is None or m[k]]
        if not diffs:
            judged = {"rollout/logprob_guard_unchecked": 1.0}
        else:
            value = math.fsum(diffs) / len(diffs)
            judged = {"rollout/logprob_guard_diff": value}
            if value <= self.bound:  # NaN (an engine that returned no log-prob) counts as above
                self.over = []
            else:
                self.over.append(value)
        judged["rollout/logprob_guard_streak"] = float(len(self.over))
        if self.tripped:
            judged["rollout/logprob_guard_stop"] = 1.0
        return judged

    @property
    def tripped(self) -> bool:
        return self.active and len(self.over) >= self.patience

    def enforce(self, step: int) -> None:
        """Raise LogprobMismatch when the bound was exceeded `patience` steps in a row (call after the step's
        records are handed to the observer: the doctor reads them)."""
        if not self.tripped:
            return
        first = step - len(self.over) + 1
        values = ", ".join(f"{v:.3g}" for v in self.over[-5:])
        origin = f" (the default for actor.dtype={self.dtype})" if self.default else ""
        raise LogprobMismatch(
            f"stopped at step {step}: the rollout engine's and the trainer's log-probs of the same tokens differ by "
            f"{values} (mean |diff| per token, steps {first}..{step}), above trainer.max_logprob_diff={self.bound:g}"
            f"{origin} for trainer.logprob_diff_patience={self.patience} steps.\n"
            f"  Find where: mgrpo-doctor run {self.run_dir}\n"
            f"  Go on anyway: trainer.max_logprob_diff=<bound> or trainer.logprob_diff_patience=0, with "
            f"trainer.resume=auto (from the last checkpoint)")
