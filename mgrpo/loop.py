"""The GRPO loop: the one place where every room meets (DESIGN.md section 1).

    prompts -> rollout -> judge -> log-probs (old, ref) -> advantages -> update -> weight sync -> observe

`Trainer(config).fit()` is the Python front door; `mgrpo-train` builds the same config from Hydra.
"""

from __future__ import annotations

import logging
import os

from mgrpo.config import MGRPOConfig, output_dir, resolve_device, validate
from mgrpo.experience import Experience
from mgrpo.observe.timing import PhaseTimer
from mgrpo.rollout.types import SamplingParams
from mgrpo.runtime import Runtime

log = logging.getLogger("mgrpo")


class StopRequested(Exception):
    """The run stopped early on request (SIGUSR1) after writing a checkpoint; resume continues it."""


class Trainer:
    def __init__(self, config: MGRPOConfig):
        self.cfg = config = resolve_device(config)
        self.layout = validate(config)  # every config error surfaces here, before any process exists
        self.run_dir = output_dir(config)
        self.rt: Runtime | None = None

    def fit(self) -> dict:
        """Train; return the last step's metrics. Ctrl-C stops cleanly (files flushed, Ray shut down)."""
        self.rt = rt = Runtime(self.cfg, self.layout, self.run_dir)
        try:
            rt.start()
            if self.cfg.trainer.val_before_train and rt.step == 0:
                rt.tracker.log(self.evaluate(), step=0)
            metrics: dict = {}
            while rt.step < rt.total_steps:
                metrics = self.train_step()
                rt.after_step(metrics)
                if rt.stop_requested:
                    path = rt.save_checkpoint()
                    raise StopRequested(f"stopped at step {rt.step} on request; checkpoint {path}; "
                                        "run again with trainer.resume=auto to continue")
                if rt.should_test():
                    val = self.evaluate()
                    rt.tracker.log(val, step=rt.step)
                    metrics.update(val)
            rt.finish()
            return metrics
        except KeyboardInterrupt:
            log.warning("interrupted at step %d: flushing files and shutting down", rt.step)
            raise
        finally:
            rt.close()

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, rt = self.cfg, self.rt
        timer, metrics = PhaseTimer(), {}
        with timer("step"):
            with timer("rollout"):  # generation (timing_s/gen) and judging (timing_s/reward)
                exp = self.generate_and_judge(metrics)
            rt.release_rollout_memory()
            if cfg.algorithm.overlong_filter:
                metrics["response_length/overlong_filtered"] = exp.apply_overlong_filter()

            everything = list(range(len(exp)))
            temperature = cfg.rollout.temperature
            with timer("old_logprob"):  # pi_old: the weights that sampled, recomputed by the trainer
                out = rt.logprobs(exp, everything, "actor", temperature)
                exp.old_logprobs, exp.entropy = out["logprobs"], out["entropy"]
            if rt.need_ref:
                with timer("ref"):
                    exp.ref_logprobs = rt.logprobs(exp, everything, "ref", temperature)["logprobs"]
            with timer("adv"):
                exp.compute_advantages(cfg)

            with timer("update_actor"):  # one optimizer step per mini-batch, ppo_epochs passes
                updates = []
                for epoch in range(cfg.actor.ppo_epochs):
                    for idx in exp.mini_batches(cfg, epoch_seed=cfg.trainer.seed * 1_000_003 + rt.step * 101 + epoch):
                        shards = exp.rank_batches(idx, self.layout.dp, cfg, for_training=True)
                        updates.append(rt.trainer.train_mini_batch(shards, temperature))
                metrics.update(mean_metrics(updates))
                metrics["actor/updates"] = float(len(updates))

            with timer("update_weights"):
                metrics.update(rt.sync_weights())

        metrics.update(timer.metrics())
        metrics.update(rt.step_metrics(exp, metrics))
        rt.write_trajectories(exp)
        return metrics

    def generate_and_judge(self, metrics: dict) -> Experience:
        """Sample n responses per prompt and score them; with dynamic sampling keep only groups whose
        rewards differ, generating more rounds until the batch is full."""
        cfg, rt = self.cfg, self.rt
        sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=cfg.data.max_response_length,
                                  seed=rt.sampling_seed())
        if not cfg.algorithm.filter_groups.enable:
            return rt.rollout_and_score(rt.train_data.next_batch(), cfg.rollout.n, sampling, metrics)
        from mgrpo.algorithms.filtering import GroupAccumulator

        acc = GroupAccumulator(cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches)
        rounds: list[Experience] = []
        while not acc.full and not acc.exhausted:
            sampling = SamplingParams(**{**sampling.__dict__, "seed": rt.sampling_seed(len(rounds))})
            exp = rt.rollout_and_score(rt.train_data.next_batch(), cfg.rollout.n, sampling, metrics)
            acc.add([(len(rounds), i) for i in range(len(exp))], exp.rewards, exp.group_index)
            rounds.append(exp)
        groups = acc.take()
        metrics.update(acc.metrics())
        if not groups:
            raise RuntimeError(f"dynamic sampling kept no prompt group in {acc.num_gen_batches} rounds "
                               "(algorithm.filter_groups.max_num_gen_batches)")
        return Experience.concat([rounds[g[0][0]].select([i for _, i in g]) for g in groups])

    # --- evaluation -----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """n samples per validation prompt; mean@n and pass@n per data_source (val/<data_source>/...)."""
        from mgrpo.rewards import eval_metrics

        cfg, rt = self.cfg, self.rt
        ev = cfg.evaluation
        sampling = SamplingParams(temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=cfg.data.max_response_length,
                                  seed=cfg.trainer.seed + 7919)
        items = rt.val_data.all_items(limit=ev.max_prompts)
        timer = PhaseTimer()
        with timer("validation"):
            exp = rt.rollout_and_score(items, ev.n, sampling, {}, desc="validation")
        out = eval_metrics(exp.scores, exp.group_index, [it.data_source for it in exp.items], ev.n)
        out.update(timer.metrics())
        return out


def mean_metrics(updates: list[dict]) -> dict:
    """Metrics of several optimizer steps: the mean of each (counters such as skipped steps are
    cumulative, so their last value is kept)."""
    out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    out["actor/skipped_steps"] = updates[-1]["actor/skipped_steps"]
    return out


def train(config: MGRPOConfig) -> dict:
    """Convenience: validate, train, return the final metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Trainer(config).fit()
