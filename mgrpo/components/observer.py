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
"""trainer.log_token_logprobs=null writes token log-probs when a step has at most this many response tokens."""


def log_token_logprobs(cfg: MGRPOConfig) -> bool:
    """trainer.log_token_logprobs resolved: null = on when a step's response tokens (train_batch_size x n x
    max_response_length) are at most LOG_TOKEN_LOGPROBS_AUTO_TOKENS. A token costs ~45 bytes of JSON (its id
    and two log-probs at full precision, which a 1e-7 difference needs), so a small step adds under 1 MB to
    trajectories.jsonl (the default job, 1024 tokens a step: 7.6 MB over 150 steps); recipe=qwen3-8b-gsm8k-grpo
    (128 x 5 x 1024 tokens) would add ~30 MB a step, so it is off there unless asked for."""
    t = cfg.trainer
    if t.log_token_logprobs is not None:
        return bool(t.log_token_logprobs)
    tokens = cfg.data.train_batch_size * cfg.rollout.n * cfg.data.max_response_length
    return tokens <= LOG_TOKEN_LOGPROBS_AUTO_TOKENS


class Observer:
    def __init__(self, run_dir: str, t: TrainerConfig, *, total_steps: int, resume_step: Optional[int],
                 token_logprobs: bool = False, config_text: Optional[str] = None):
        self.tracker = Tracker(run_dir, t.logger, total_steps=total_steps, resume_step=resume_step,
                               config_text=config_text)
        self.token_logprobs = token_logprobs
        """Trajectory lines carry token ids and both sides' per-token log-probs (`log_token_logprobs`)."""
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
        rows = [
            {"prompt": it.prompt_text, "response": text, "reward": rew, "score": sc,
             "advantage": adv[0] if adv else 0.0, "weight_version": ver, "finish_reason": fr,
             "data_source": it.data_source, "group": g, "engine": e}
            for it, text, rew, sc, adv, ver, fr, g, e in zip(
                exp.items, exp.response_texts, exp.rewards, exp.scores, exp.advantages or [[]] * len(exp),
                exp.weight_versions, exp.finish_reasons, exp.group_index, exp.engines or [None] * len(exp))
        ]
        for row, outcome, by in zip(rows, exp.outcomes, exp.failed_by):
            if outcome != "ok":  # no reward (score null): why, and whose
                row.update(reward_status=outcome, failed_by=by)
        if self.token_logprobs:  # what mgrpo-doctor reads: both sides of rollout/logprob_abs_diff, token by token
            for row, p, r, ro, tr in zip(rows, exp.prompt_ids, exp.response_ids, exp.rollout_logprobs,
                                         exp.old_logprobs or [None] * len(exp)):
                row.update(prompt_ids=p, response_ids=r, rollout_logprobs=ro, trainer_logprobs=tr)
            if exp.teacher_logprobs is not None:  # on-policy distillation: the teacher's side, token by token
                for row, te in zip(rows, exp.teacher_logprobs):
                    row["teacher_logprobs"] = te
        if exp.turns is not None:  # multi-turn: turns (role, token span, text, calls, errors, latency), finish
            for row, t, m in zip(rows, exp.turns, exp.sampled_mask or [None] * len(exp)):
                row.update(multi_turn=t, sampled_mask=m)
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
