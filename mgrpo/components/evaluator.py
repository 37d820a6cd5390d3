"""Validation: when it runs (trainer.test_freq, trainer.val_before_train) and what it measures (evaluation.n
samples per validation prompt, mean@n and pass@n per data_source, logged as val/<data_source>/...)."""

from __future__ import annotations

from typing import Sequence

from mgrpo.config import seeds
from mgrpo.config.schema import EvaluationConfig
from mgrpo.observe.metrics import summed
from mgrpo.observe.timing import PhaseTimer
from mgrpo.rollout.types import SamplingParams


class Evaluator:
    def __init__(self, cfg: EvaluationConfig, *, test_freq: int, val_before_train: bool, seed: int,
                 max_response_length: int, val_data, experiences, stop: Sequence[str] = (),
                 stop_regex: Sequence[str] = ()):
        self.cfg, self.test_freq, self.val_before_train = cfg, test_freq, val_before_train
        # rollout.stop / stop_regex: a response is judged as it was trained, ending where training's ends
        self.sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, stop=tuple(stop),
                                       stop_regex=tuple(stop_regex), max_new_tokens=max_response_length,
                                       seed=seeds.eval_seed(seed))
        """The same draws at every evaluation: scores move only with the weights."""
        self.val_data = val_data
        self.experiences = experiences
        """`ExperienceMaker`: generates and judges, the engines held still around it."""

    def before_training(self, step: int) -> bool:
        return self.val_before_train and step == 0

    def due(self, step: int, total_steps: int) -> bool:
        """Every trainer.test_freq steps, and after the last one."""
        return self.test_freq > 0 and (step % self.test_freq == 0 or step == total_steps)

    def run(self) -> tuple[dict, dict]:
        """The validation metrics, and what generating and judging them measured (the run-long counters
        take its counts; the validation record does not show them)."""
        from mgrpo.rewards import eval_metrics

        timer = PhaseTimer()
        with timer("validation"), self.experiences.idle():
            exp, generated = self.experiences.generate(self.val_data.all_items(limit=self.cfg.max_prompts),
                                                       self.cfg.n, self.sampling, desc="validation",
                                                       training=False)
            judged = self.experiences.judge(exp, training=False)
        out = eval_metrics(exp.scores, exp.group_index, [it.data_source for it in exp.items], self.cfg.n)
        return {**out, **timer.metrics()}, summed(generated, judged)
