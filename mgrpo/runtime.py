"""Everything the GRPO loop runs on: processes, data, judges, logs and checkpoints.

`loop.py` says *what* happens in a step; this module owns *where* it happens and what is kept:
it starts Ray and places the trainer ranks and rollout engines, holds the datasets and the judger,
moves experience to and from the trainer, syncs weights, writes metrics, trajectories and
checkpoints, and resumes a killed run from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from typing import Optional

from mgrpo.config import Layout, MGRPOConfig
from mgrpo.experience import Experience

log = logging.getLogger("mgrpo")

STATE_FILE = "trainer_state.json"


class Runtime:
    def __init__(self, cfg: MGRPOConfig, layout: Layout, run_dir: str):
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        self.step = 0
        self.weight_version = 0
        self.need_ref = cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.trainer = self.rollout = self.tracker = self.trajectories = self.judger = None
        self.counters = {"reward/failed": 0, "reward/timeout": 0, "rollout/retries": 0, "rollout/restarts": 0}
        self._ray_started = False
        self.stop_requested = False

    # --- start ----------------------------------------------------------------------------------------
    def _on_stop_signal(self, signum, frame) -> None:
        log.warning("signal %d: finishing step %d, then checkpoint and exit", signum, self.step + 1)
        self.stop_requested = True

    def start(self) -> None:
        from mgrpo.data import PromptDataset, load_tokenizer
        from mgrpo.observe.tracker import Tracker, truncate_jsonl
        from mgrpo.observe.trajectories import TrajectoryWriter
        from mgrpo.rewards import Judger, check_data_sources

        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            # SIGUSR1 (SLURM's warning before the time limit): stop after this step with a checkpoint.
            signal.signal(signal.SIGUSR1, self._on_stop_signal)
        # Data and judges first: an unknown data_source or a bad record fails before any process starts.
        self.tokenizer = load_tokenizer(cfg.model)
        self.train_data = PromptDataset(cfg.data, self.tokenizer, cfg.data.train_files, split="train")
        self.val_data = PromptDataset(cfg.data, self.tokenizer, cfg.data.val_files, split="val")
        check_data_sources(self.train_data.data_sources() | self.val_data.data_sources(), cfg.reward)
        self.judger = Judger(cfg.reward)
        self.total_steps = self._total_steps()

        resume_dir = self._resume_dir()
        state = self._read_state(resume_dir) if resume_dir else None
        init_dir = self._initial_weights()

        self._start_processes(init_dir)
        if state is not None:
            self._restore(resume_dir, state)
        resumed = self.step if state is not None else None
        self.tracker = Tracker(self.run_dir, cfg.trainer.logger, total_steps=self.total_steps, resume_step=resumed)
        if cfg.trainer.log_trajectories:
            path = os.path.join(self.run_dir, "trajectories.jsonl")
            if resumed is not None:
                truncate_jsonl(path, resumed)
            self.trajectories = TrajectoryWriter(path)
        log.info("run dir %s | trainer ranks %d (tp=%d pp=%d cp=%d dp=%d) | engines %d | steps %d..%d",
                 self.run_dir, self.layout.trainer_world, cfg.actor.tp, cfg.actor.pp, cfg.actor.cp, self.layout.dp,
                 cfg.rollout.num_engines, self.step, self.total_steps)

    def _total_steps(self) -> int:
        t = self.cfg.trainer
        if t.total_training_steps is not None:
            return t.total_training_steps
        return t.total_epochs * self.train_data.batches_per_epoch()

    def _initial_weights(self) -> str:
        """The HF directory every process starts from: the user's checkpoint, or a seeded random init
        written once per run (so every TP/PP layout and the rollout engines start identical)."""
        from mgrpo.models import check_hf_config, init_hf_checkpoint

        m = self.cfg.model
        if m.hf_path:
            check_hf_config(m.hf_path, m)
            return m.hf_path
        path = os.path.join(self.run_dir, "init_hf")
        if not os.path.isfile(os.path.join(path, "config.json")):
            init_hf_checkpoint(path, m, seed=self.cfg.trainer.seed, tokenizer=self.tokenizer)
        return path

    def _start_processes(self, init_dir: str) -> None:
        from mgrpo.cluster.ray_env import reserve, start_ray
        from mgrpo.cluster.rollout_group import RolloutGroup
        from mgrpo.cluster.trainer_group import TrainerGroup

        cfg, lay = self.cfg, self.layout
        cuda = cfg.trainer.device == "cuda"
        cpus = cfg.trainer.cpus_per_worker
        # On CPU the bundles are logical: Ray is told exactly how many it may hand out.
        start_ray(address=cfg.trainer.ray_address,
                  num_cpus=None if cuda else cpus * (lay.trainer_world + cfg.rollout.num_engines) + 1)
        self._ray_started = True
        self.trainer_bundles = reserve(lay.trainer_world, cpus=cpus, gpus=1 if cuda else 0, name="mgrpo-trainer")
        self.rollout_bundles = reserve(cfg.rollout.num_engines, cpus=cpus,
                                       gpus=cfg.rollout.tp if cuda and cfg.rollout.mode == "disaggregated" else 0,
                                       name="mgrpo-rollout")
        eos = [self.tokenizer.eos_token_id]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        self.rollout = RolloutGroup(cfg, self.rollout_bundles, hf_dir=init_dir, eos_token_ids=eos, pad_token_id=pad,
                                    log_dir=os.path.join(self.run_dir, "logs"))
        self.trainer = TrainerGroup(cfg, lay, self.trainer_bundles, init_hf_dir=init_dir,
                                    total_steps=self.total_steps, need_ref=self.need_ref)
        self.rollout.on_restart = lambda engines: self.trainer.sync_weights(
            self.rollout.receivers(engines), self.cfg.rollout.update_weights_bucket_mb << 20)

    # --- per-step services used by the loop ----------------------------------------------------------
    def sampling_seed(self, round_: int = 0) -> int:
        """Rollout randomness is a function of (seed, step, round): a resumed run samples as the
        uninterrupted one would have."""
        return self.cfg.trainer.seed * 1_000_003 + self.step * 1_009 + round_

    def rollout_and_score(self, items, n, sampling, metrics: dict, desc: str = "rollout") -> Experience:
        from mgrpo.algorithms.filtering import apply_overlong_buffer
        from mgrpo.rewards import ScoreRequest

        import torch

        results, stats = self.rollout.generate([it.prompt_ids for it in items], n, sampling, desc=desc)
        exp = Experience.from_rollout(items, results, n)
        exp.response_texts = self.tokenizer.batch_decode(exp.response_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        scored = self.judger.score([
            ScoreRequest(data_source=it.data_source, response=text, ground_truth=it.ground_truth,
                         extra_info={**(it.extra_info or {}), "finish_reason": fr})
            for it, text, fr in zip(exp.items, exp.response_texts, exp.finish_reasons)
        ])
        exp.scores = [float(s) for s in scored.scores]
        shaped, penalised = apply_overlong_buffer(torch.tensor(exp.scores), torch.tensor([len(r) for r in exp.response_ids]),
                                                  self.cfg.data.max_response_length, self.cfg.algorithm.overlong_buffer)
        exp.rewards = shaped.tolist()
        metrics["timing_s/gen"] = metrics.get("timing_s/gen", 0.0) + stats.seconds
        for key, value in (("reward/failed", scored.failed), ("reward/timeout", scored.timeout),
                           ("rollout/retries", stats.retries), ("rollout/restarts", stats.restarts)):
            self.counters[key] += value
            metrics[key] = metrics.get(key, 0) + value
        metrics["reward/overlong_penalised"] = metrics.get("reward/overlong_penalised", 0) + penalised
        metrics["timing_s/reward"] = metrics.get("timing_s/reward", 0.0) + time.perf_counter() - t0
        return exp

    def logprobs(self, exp: Experience, idx: list[int], which: str, temperature: float) -> dict:
        shards = exp.rank_batches(idx, self.layout.dp, self.cfg, for_training=False)
        outs = self.trainer.compute_logprobs(shards, which, temperature)
        return {k: exp.merge_shards(idx, self.layout.dp, [o[k] for o in outs]) for k in ("logprobs", "entropy")}

    def release_rollout_memory(self) -> None:
        """Colocated engines give their accelerator memory to the trainer between generation and sync."""
        if self.cfg.rollout.mode == "colocated":
            self.rollout.release_memory()

    def sync_weights(self) -> dict:
        t0 = time.perf_counter()
        colocated = self.cfg.rollout.mode == "colocated"
        self.rollout.health_check()
        if colocated:
            self.rollout.resume_memory(["weights"])  # room for the new weights, KV cache still released
        sent = self.trainer.sync_weights(self.rollout.receivers(), self.cfg.rollout.update_weights_bucket_mb << 20)
        self.weight_version += 1
        self.rollout.finish_weight_update(self.weight_version)
        if colocated:
            self.rollout.resume_memory()
        seconds = time.perf_counter() - t0
        return {"perf/update_weights_bytes": float(sent["bytes"]), "rollout/weight_version": float(self.weight_version),
                "perf/update_weights_gbps": sent["bytes"] / max(seconds, 1e-9) / 1e9}

    def step_metrics(self, exp: Experience, metrics: dict) -> dict:
        from mgrpo.observe.metrics import experience_metrics

        out = experience_metrics(exp, max_response_length=self.cfg.data.max_response_length)
        tokens = sum(len(p) + len(r) for p, r in zip(exp.prompt_ids, exp.response_ids))
        out["perf/total_tokens"] = float(tokens)
        out["perf/throughput"] = tokens / max(metrics.get("timing_s/step", 1e-9), 1e-9) / self.layout.total
        out["data/filtered_prompts"] = float(self.train_data.num_filtered)
        out["data/epoch"] = float(self.train_data.epoch)
        for key, value in self.counters.items():
            out[key + "_total"] = float(value)
        return out

    def write_trajectories(self, exp: Experience) -> None:
        if self.trajectories is None:
            return
        self.trajectories.write(self.step + 1, [  # the step number its metrics are logged under
            {"prompt": it.prompt_text, "response": text, "reward": rew, "score": sc,
             "advantage": adv[0] if adv else 0.0, "weight_version": ver, "finish_reason": fr,
             "data_source": it.data_source, "group": g}
            for it, text, rew, sc, adv, ver, fr, g in zip(exp.items, exp.response_texts, exp.rewards, exp.scores,
                                                           exp.advantages, exp.weight_versions, exp.finish_reasons,
                                                           exp.group_index)
        ])

    def after_step(self, metrics: dict) -> None:
        self.step += 1
        self.tracker.log(metrics, step=self.step)
        freq = self.cfg.trainer.save_freq
        if freq > 0 and self.step % freq == 0 and self.step < self.total_steps:
            self.save_checkpoint()

    def should_test(self) -> bool:
        f = self.cfg.trainer.test_freq
        return f > 0 and (self.step % f == 0 or self.step == self.total_steps)

    # --- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Megatron distributed checkpoint (weights + optimizer) plus the driver's state, published by
        rewriting `checkpoints/latest` only once everything is on disk."""
        root = os.path.join(self.run_dir, "checkpoints")
        path = os.path.join(root, f"step_{self.step:06d}")
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
        self.trainer.save_checkpoint(os.path.join(path, "megatron"))
        state = {"step": self.step, "weight_version": self.weight_version, "counters": self.counters,
                 "train_data": self.train_data.state_dict(), "config_name": self.cfg.model.name}
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(state, f, indent=1)
        for fl in (self.tracker, self.trajectories):
            if fl is not None:
                fl.flush()
        tmp = os.path.join(root, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(root, "latest"))
        log.info("checkpoint saved: %s", path)
        return path

    def _resume_dir(self) -> Optional[str]:
        r = self.cfg.trainer.resume
        if r == "disable":
            return None
        if r != "auto":
            return r
        latest = os.path.join(self.run_dir, "checkpoints", "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            return os.path.join(self.run_dir, "checkpoints", f.read().strip())

    @staticmethod
    def _read_state(path: str) -> dict:
        file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"trainer.resume: {path} has no {STATE_FILE}")
        with open(file) as f:
            return json.load(f)

    def _restore(self, path: str, state: dict) -> None:
        self.trainer.load_checkpoint(os.path.join(path, "megatron"))
        self.step = int(state["step"])
        self.counters.update(state.get("counters", {}))
        self.train_data.load_state_dict(state["train_data"])
        # Engines started from the initial weights: bring them to the checkpoint's version.
        self.trainer.sync_weights(self.rollout.receivers(), self.cfg.rollout.update_weights_bucket_mb << 20)
        self.weight_version = int(state["weight_version"])
        self.rollout.finish_weight_update(self.weight_version)
        log.info("resumed from %s at step %d (weight version %d)", path, self.step, self.weight_version)

    # --- end ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        if self.cfg.trainer.save_freq != 0:
            self.save_checkpoint()
        if self.cfg.trainer.save_hf:
            out = os.path.join(self.run_dir, "hf")
            tokenizer_dir = os.path.join(self.run_dir, "tokenizer")
            self.tokenizer.save_pretrained(tokenizer_dir)
            self.trainer.save_hf(out, tokenizer_dir)  # trainer ranks stream their stages to disk
            log.info("HF checkpoint written to %s", out)

    def close(self) -> None:
        for closer in (self.tracker, self.trajectories):
            if closer is not None:
                closer.close()
        if self.judger is not None:
            self.judger.close()
        for group in (self.rollout, self.trainer):
            if group is not None:
                try:
                    group.shutdown()
                except Exception as err:  # shutting down after a failure must not hide the failure
                    log.warning("shutdown of %s failed: %s", type(group).__name__, err)
        if self._ray_started:
            from mgrpo.cluster.ray_env import stop_ray

            stop_ray()
