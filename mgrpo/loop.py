"""The GRPO loop: the one place where every room meets (docs/architecture.md: one step, as data flows).

    prompts -> rollout -> judge -> log-probs (old, ref) -> advantages -> update -> weight sync -> observe

`Trainer(config).fit()` is the Python front door; `mgrpo-train` builds the same config from Hydra.
The Trainer assembles parts that each have one job (`mgrpo/components/`): the trainer client (data-parallel
sharding, Megatron ranks), the rollout group (engines), the weight sync, the checkpointer, the observer
(every run file) and the stop signal. The phases below only call them.
"""

from __future__ import annotations

import contextlib
import logging
import os

from mgrpo.components.checkpoint import RunState
from mgrpo.config import MGRPOConfig, output_dir, resolve_device, seeds, validate
from mgrpo.experience import Experience
from mgrpo.observe.metrics import step_metrics
from mgrpo.observe.timing import PhaseTimer
from mgrpo.rollout.types import SamplingParams

log = logging.getLogger("mgrpo")


class StopRequested(Exception):
    """The run stopped early on request (SIGUSR1/SIGTERM) after writing a checkpoint; resume continues it."""


class Trainer:
    def __init__(self, config: MGRPOConfig):
        self.cfg = config = resolve_device(config)
        self.layout = validate(config)  # every config error surfaces here, before any process exists
        from mgrpo.cluster.memory_plan import check_fits

        self.memory = check_fits(config)  # a run that cannot fit fails now, not after hours in the queue
        self.run_dir = output_dir(config)
        self.need_ref = config.algorithm.use_kl_loss or config.algorithm.use_kl_in_reward
        self.trainer = self.rollout = self.observer = self.judger = self.placement = self.pipeline = None
        self.state = RunState()
        self._handed_over = None  # the experience `_generation_done` last handed to the trainer

    def fit(self) -> dict:
        """Train; return the last step's metrics. Ctrl-C stops cleanly (files flushed, Ray shut down)."""
        from mgrpo.components.signals import StopSignal

        self.stop = StopSignal()
        try:
            self._start()
            self.stop.install()  # after Ray's init, which installs a SIGTERM handler of its own
            if self.cfg.trainer.val_before_train and self.state.step == 0:
                self.observer.log(self.evaluate(), step=0)
            self.pipeline = self._start_pipeline()
            metrics: dict = {}
            while self.state.step < self.total_steps:
                metrics = self.train_step()
                self.state.step += 1
                self.observer.log(metrics, step=self.state.step)
                if self.pipeline is not None:
                    self.pipeline.step_done()
                if self.stop.requested:
                    path = self.save_checkpoint()
                    raise StopRequested(f"stopped at step {self.state.step} on request; checkpoint {path}; "
                                        "run again with trainer.resume=auto to continue")
                if self._due(self.cfg.trainer.save_freq) and self.state.step < self.total_steps:
                    self.save_checkpoint()
                if self._due(self.cfg.trainer.test_freq) or (self.cfg.trainer.test_freq > 0
                                                             and self.state.step == self.total_steps):
                    with self._engines_idle():
                        val = self.evaluate()
                    self.observer.log(val, step=self.state.step)
                    metrics.update(val)
            self._finish()
            return metrics
        except KeyboardInterrupt:
            log.warning("interrupted at step %d: flushing files and shutting down", self.state.step)
            raise
        finally:
            self._close()

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, timer, metrics = self.cfg, PhaseTimer(), {}
        with timer("step"):
            with timer("rollout"):  # generation (timing_s/gen) and judging (timing_s/reward), or waiting for them
                if self.pipeline is not None:
                    exp = self.pipeline.next(self.state.weight_version, metrics)
                    self.state.count({"rollout/stale_dropped": metrics.pop("rollout/stale_dropped")}, metrics)
                else:
                    exp = self.generate_and_judge(metrics, self.state.step,
                                                  before_judging=lambda e: self._generation_done(e, metrics))
            self._generation_done(exp, metrics)
            if cfg.algorithm.overlong_filter:
                metrics["response_length/overlong_filtered"] = exp.apply_overlong_filter()
            if self.trainer.needs_old_logprobs(exp):  # else the one update takes pi_old from its own forward
                with timer("old_logprob"):  # pi_old: the weights that sampled, recomputed by the trainer
                    out = self.trainer.compute_logprobs(exp, "actor")
                    exp.old_logprobs, exp.entropy = out["logprobs"], out["entropy"]
            if self.need_ref and not self.trainer.kept(exp, "ref"):  # else the update runs on the kept ones
                with timer("ref"):
                    exp.ref_logprobs = self.trainer.compute_logprobs(exp, "ref")["logprobs"]
            with timer("adv"):
                exp.compute_advantages(cfg)
            with timer("update_actor"):  # one optimizer step per mini-batch, ppo_epochs passes
                metrics.update(self.trainer.train(exp, self.state.step))
            with timer("update_weights"):
                with self._engines_idle():  # asynchronous rollout: the batch in flight finishes first
                    self.state.weight_version += 1
                    synced = self.weights.sync(self.state.weight_version)
                self.state.count({"rollout/restarts": synced.pop("rollout/restarts")}, metrics)
                metrics.update(synced)
        metrics.update(timer.metrics())
        metrics.update(step_metrics(exp, metrics, cfg, self.layout, self.train_data, self.state.counters))
        self.observer.write_trajectories(self.state.step + 1, exp)  # the step its metrics are logged under
        return metrics

    def _generation_done(self, exp: Experience, metrics: dict) -> None:
        """The step's samples are generated (once per step; a second call does nothing): colocated engines
        give their accelerator memory back, then the trainer starts the log-prob forwards the step needs.
        Called between generation and judging, those forwards run while the driver judges."""
        if self._handed_over is exp:
            return
        self._handed_over = exp
        self.state.count(self.weights.release_engines(), metrics)
        if self.trainer.needs_old_logprobs(exp):
            self.trainer.start_logprobs(exp, "actor")
        if self.need_ref:  # kept on the ranks when only the update reads them
            self.trainer.start_logprobs(exp, "ref", keep=self.trainer.keeps_ref(exp))

    def generate_and_judge(self, metrics: dict, batch: int, before_judging=None) -> Experience:
        """Sample n responses per prompt for batch `batch` (the step that trains it) and score them; with
        dynamic sampling keep only groups whose rewards differ, generating more rounds until the batch is full.
        `before_judging(exp)` runs between generation and judging when the samples generated are the batch
        (no dynamic sampling)."""
        cfg = self.cfg

        def sampling(round_: int) -> SamplingParams:
            return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=cfg.data.max_response_length,
                                  seed=seeds.sampling_seed(cfg.trainer.seed, batch, round_))

        if not cfg.algorithm.filter_groups.enable:
            return self.rollout_and_judge(self.train_data.next_batch(), cfg.rollout.n, sampling(0), metrics,
                                          before_judging=before_judging)
        from mgrpo.algorithms.filtering import GroupAccumulator

        acc = GroupAccumulator(cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches)
        rounds: list[Experience] = []
        while not acc.full and not acc.exhausted:
            exp = self.rollout_and_judge(self.train_data.next_batch(), cfg.rollout.n, sampling(len(rounds)), metrics)
            acc.add([(len(rounds), i) for i in range(len(exp))], exp.rewards, exp.group_index)
            rounds.append(exp)
        groups = acc.take()
        metrics.update(acc.metrics())
        if not groups:
            raise RuntimeError(f"dynamic sampling kept no prompt group in {acc.num_gen_batches} rounds "
                               "(algorithm.filter_groups.max_num_gen_batches)")
        return Experience.concat([rounds[g[0][0]].select([i for _, i in g]) for g in groups])

    def rollout_and_judge(self, items, n: int, sampling: SamplingParams, metrics: dict,
                          desc: str = "rollout", before_judging=None) -> Experience:
        timer = PhaseTimer()
        results, stats = self.rollout.generate([it.prompt_ids for it in items], n, sampling, desc=desc)
        exp = Experience.from_rollout(items, results, n)
        if before_judging is not None:
            before_judging(exp)
        with timer("reward"):
            counts = exp.judge(self.judger, self.tokenizer, self.cfg)
        self.state.count({**counts, "rollout/retries": stats.retries, "rollout/restarts": stats.restarts}, metrics)
        metrics["timing_s/gen"] = metrics.get("timing_s/gen", 0.0) + stats.seconds
        metrics["timing_s/reward"] = metrics.get("timing_s/reward", 0.0) + timer.metrics()["timing_s/reward"]
        return exp

    # --- evaluation -----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """n samples per validation prompt; mean@n and pass@n per data_source (val/<data_source>/...)."""
        from mgrpo.rewards import eval_metrics

        cfg, ev = self.cfg, self.cfg.evaluation
        sampling = SamplingParams(temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=cfg.data.max_response_length,
                                  seed=seeds.eval_seed(cfg.trainer.seed))
        timer = PhaseTimer()
        with timer("validation"):
            exp = self.rollout_and_judge(self.val_data.all_items(limit=ev.max_prompts), ev.n, sampling, {},
                                         desc="validation")
        out = eval_metrics(exp.scores, exp.group_index, [it.data_source for it in exp.items], ev.n)
        out.update(timer.metrics())
        return out

    # --- asynchronous rollout ---------------------------------------------------------------------------
    def _start_pipeline(self):
        """rollout.async_mode != off: a producer generating ahead of the trainer (components/rollout_pipeline.py)."""
        r = self.cfg.rollout
        if r.async_mode == "off":
            return None
        from mgrpo.components.rollout_pipeline import RolloutPipeline

        pipeline = RolloutPipeline(lambda batch, metrics: self.generate_and_judge(metrics, batch),
                                   max_staleness=1 if r.async_mode == "one_step_off" else r.max_staleness,
                                   first_batch=self.state.step)
        if self.state.pending is not None:
            pipeline.load_state_dict(self.state.pending, self.train_data.items)
        pipeline.start()
        return pipeline

    def _engines_idle(self):
        """Hold the rollout engines still (asynchronous rollout): the batch in flight finishes, no new one starts."""
        return self.pipeline.paused() if self.pipeline is not None else contextlib.nullcontext()

    # --- assembly -------------------------------------------------------------------------------------
    def _start(self) -> None:
        from mgrpo.components.assemble import build

        p = build(self.cfg, self.layout, self.run_dir, need_ref=self.need_ref)
        self.tokenizer, self.train_data, self.val_data, self.judger = p.tokenizer, p.train_data, p.val_data, p.judger
        self.placement, self.trainer, self.rollout, self.weights = p.placement, p.trainer, p.rollout, p.weights
        self.checkpointer, self.observer, self.state, self.total_steps = (p.checkpointer, p.observer, p.state,
                                                                          p.total_steps)

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.state.step % freq == 0

    def save_checkpoint(self) -> str:
        with self._engines_idle():  # the data position and the batches ready agree
            pending = self.pipeline.state_dict() if self.pipeline is not None else None
            return self.checkpointer.save(self.state, self.trainer, self.train_data, self.observer, pending)

    def _finish(self) -> None:
        if self.cfg.trainer.save_freq != 0:
            self.save_checkpoint()
        if self.cfg.trainer.save_hf:
            out, tokenizer_dir = os.path.join(self.run_dir, "hf"), os.path.join(self.run_dir, "tokenizer")
            self.tokenizer.save_pretrained(tokenizer_dir)
            self.trainer.save_hf(out, tokenizer_dir)  # trainer ranks stream their stages to disk
            log.info("HF checkpoint written to %s", out)

    def _close(self) -> None:
        from mgrpo.components.assemble import close

        self.stop.uninstall()
        if self.pipeline is not None:
            self.pipeline.close()
        close(self.observer, self.judger, self.rollout, self.trainer)


def train(config: MGRPOConfig) -> dict:
    """Convenience: validate, train, return the final metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Trainer(config).fit()
