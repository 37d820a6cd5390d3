"""The observer: the only writer of a run's record files.

It owns the tracker (TensorBoard, `metrics.jsonl`, one console line per step) and the trajectory file,
and it is what makes a resumed run append rather than repeat: records logged after the step a run
resumes from are dropped before anything new is written, so every step appears exactly once.

Records are written by a thread of the observer's own, in the order they were logged: JSON encoding
and TensorBoard events then run while the driver waits for the Megatron ranks and engines, not between
them. `flush()` (before every checkpoint is published) and `close()` wait until everything logged is
on disk; a write that failed raises at the next call, so nothing is lost silently.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from typing import Callable, Optional

from mgrpo.config import MGRPOConfig, TrainerConfig
from mgrpo.experience import Experience
from mgrpo.observe.tracker import Tracker, truncate_jsonl
from mgrpo.observe.trajectories import TrajectoryWriter


class _Writer:
    """One background thread running submitted writes in order."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mgrpo-observer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:  # after a failure nothing more is written (the driver raises it)
                    job()
            except BaseException as err:  # noqa: BLE001 - handed to the driver at its next call
                self._error = err
            finally:
                self._queue.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._queue.put(job)

    def drain(self) -> None:
        self._queue.join()
        self._raise()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing the run's records failed: {err}") from err


LOG_TOKEN_LOGPROBS_AUTO_TOKENS = 16384
"""trainer.log_token_logprobs=null writes token log-probs for about this many response tokens per step on average:
every step when a step has at most this many, else a sample of the steps."""


def log_token_logprobs(cfg: MGRPOConfig) -> int:
    """trainer.log_token_logprobs resolved as a step period: 0 = never, 1 = every step, k = steps 1, 1 + k, ...
    null = every step when a step's response tokens (train_batch_size x n x max_response_length) are at most
    LOG_TOKEN_LOGPROBS_AUTO_TOKENS, else every k-th step with k = ceil(tokens / that), so a large run writes the
    same volume on average and `mgrpo-doctor run` still has a sample of its steps. A token costs ~45 bytes of
    JSON (its id and two log-probs at full precision, which a 1e-7 difference needs): the default job (1024
    tokens a step) adds 7.6 MB over 150 steps; recipe=qwen3-8b-gsm8k-grpo (655,360 tokens a step) writes one
    step in 40."""
    t = cfg.trainer
    if t.log_token_logprobs is not None:
        return int(bool(t.log_token_logprobs))
    tokens = cfg.data.train_batch_size * cfg.rollout.n * cfg.data.max_response_length
    return max(1, math.ceil(tokens / LOG_TOKEN_LOGPROBS_AUTO_TOKENS))


def _sample_advantage(advantages, sampled) -> float:
    """A sample's advantage as its first token with a loss has it (a multi-turn sample's first tokens may be
    context: a forced call's are, with advantage 0); 0.0 when it has none."""
    mask = sampled if sampled is not None else [1] * len(advantages)
    return next((float(a) for a, m in zip(advantages, mask) if m), 0.0)


class Observer:
    def __init__(self, run_dir: str, t: TrainerConfig, *, total_steps: int, resume_step: Optional[int],
                 token_logprobs: int = 0, config_text: Optional[str] = None, multi_turn: bool = False):
        self.tracker = Tracker(run_dir, t.logger, total_steps=total_steps, resume_step=resume_step,
                               config_text=config_text, multi_turn=multi_turn)
        self.token_logprobs = token_logprobs
        """Every this many steps (0: never) trajectory lines carry token ids and both sides' per-token log-probs
        (`log_token_logprobs`)."""
        self.trajectories = None
        if t.log_trajectories:
            path = os.path.join(run_dir, "trajectories.jsonl")
            if resume_step is not None:
                truncate_jsonl(path, resume_step)
            self.trajectories = TrajectoryWriter(path)
        self._writer = _Writer()

    def log(self, metrics: dict, step: int) -> None:
        metrics = dict(metrics)  # the caller may go on changing its dict
        self._writer.submit(lambda: self.tracker.log(metrics, step=step))

    def write_trajectories(self, step: int, exp: Experience) -> None:
        """One line per sampled response, under the step its metrics are logged under (the experience
        is not changed after its step, so the thread reads it as it is now)."""
        if self.trajectories is not None:
            self._writer.submit(lambda: self._write_trajectories(step, exp))

    def _write_trajectories(self, step: int, exp: Experience) -> None:
        advantages = exp.advantages or [[]] * len(exp)
        sampled = exp.sampled_mask or [None] * len(exp)
        rows = [
            {"prompt": it.prompt_text, "response": text, "reward": rew, "score": sc,
             "advantage": _sample_advantage(adv, m), "weight_version": ver, "finish_reason": fr,
             "data_source": it.data_source, "ground_truth": it.ground_truth, "group": g, "engine": e}
            for it, text, rew, sc, adv, m, ver, fr, g, e in zip(
                exp.items, exp.response_texts, exp.rewards, exp.scores, advantages, sampled,
                exp.weight_versions, exp.finish_reasons, exp.group_index, exp.engines or [None] * len(exp))
        ]
        for row, outcome, by in zip(rows, exp.outcomes, exp.failed_by):
            if outcome != "ok":  # no reward (score null): why, and whose
                row.update(reward_status=outcome, failed_by=by)
        if self.token_logprobs and (step - 1) % self.token_logprobs == 0:  # what mgrpo-doctor reads: both sides of rollout/logprob_abs_diff, token by token
            for row, p, r, ro, tr in zip(rows, exp.prompt_ids, exp.response_ids, exp.rollout_logprobs,
                                         exp.old_logprobs or [None] * len(exp)):
                row.update(prompt_ids=p, response_ids=r, rollout_logprobs=ro, trainer_logprobs=tr)
            if exp.teacher_logprobs is not None:  # on-policy distillation: the teacher's side, token by token
                for row, te in zip(rows, exp.teacher_logprobs):
                    row["teacher_logprobs"] = te
        if exp.turns is not None:  # multi-turn: turns (role, token span, text, calls, errors, latency), finish
            for row, t, m in zip(rows, exp.turns, sampled):
                # the trajectory's own ending (tool_timeout, max_turns, ...): the experience keeps only
                # length/stop for overlong filtering
                row.update(multi_turn=t, sampled_mask=m, finish_reason=t["finish_reason"])
        if self.token_logprobs or exp.turns is not None:  # lines that are per token already: per-token advantages
            for row, adv in zip(rows, advantages):
                row["advantages"] = list(adv)
        self.trajectories.write(step, rows)

    def flush(self) -> None:
        """Everything logged so far is on disk (called before a checkpoint is published)."""
        self._writer.drain()
        self.tracker.flush()
        if self.trajectories is not None:
            self.trajectories.flush()

    def close(self) -> None:
        try:
            self._writer.stop()
        finally:
            self.tracker.close()
            if self.trajectories is not None:
                self.trajectories.close()
