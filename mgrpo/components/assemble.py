"""Assembling a run's parts, in the order that fails fastest, and taking them down again.

1. Data and judges: an unknown data_source or a bad record fails before any process starts.
2. The initial weights every process starts from.
3. Placement (Ray and its bundles), the trainer ranks' processes, the rollout engines (colocated ones
   take their accelerator memory before the trainer builds its model), then the Megatron stages.
4. Resume: the checkpoint's weights, optimizer, data position and driver state; the engines are
   brought to the checkpoint's weight version.
5. The observer, which drops records a previous attempt logged after the resumed step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mgrpo.components.checkpoint import Checkpointer, RunState
from mgrpo.components.observer import Observer
from mgrpo.components.trainer_client import TrainerClient
from mgrpo.components.weight_sync import WeightSync
from mgrpo.config import Layout, MGRPOConfig

log = logging.getLogger("mgrpo")


@dataclass
class Parts:
    tokenizer: object
    train_data: object
    val_data: object
    judger: object
    placement: object
    trainer: TrainerClient
    rollout: object
    weights: WeightSync
    checkpointer: Checkpointer
    observer: Observer
    state: RunState
    total_steps: int


def build(cfg: MGRPOConfig, layout: Layout, run_dir: str, *, need_ref: bool) -> Parts:
    from mgrpo.cluster.placement import colocated_devices, place
    from mgrpo.cluster.rollout_group import RolloutGroup
    from mgrpo.cluster.trainer_group import TrainerGroup
    from mgrpo.data import PromptDataset, load_tokenizer
    from mgrpo.rewards import Judger, check_data_sources
    from mgrpo.rollout.factory import EngineContext

    os.makedirs(run_dir, exist_ok=True)
    tokenizer = load_tokenizer(cfg.model)
    train_data = PromptDataset(cfg.data, tokenizer, cfg.data.train_files, split="train")
    val_data = PromptDataset(cfg.data, tokenizer, cfg.data.val_files, split="val")
    check_data_sources(train_data.data_sources() | val_data.data_sources(), cfg.reward)
    judger = Judger(cfg.reward)
    t = cfg.trainer
    total_steps = t.total_training_steps if t.total_training_steps is not None else \
        t.total_epochs * train_data.batches_per_epoch()

    checkpointer = Checkpointer(run_dir, cfg)
    resume_dir = checkpointer.resume_dir()
    if resume_dir is not None:
        checkpointer.read_state(resume_dir)  # a broken checkpoint fails before processes start
    init_dir = initial_weights(cfg, run_dir, tokenizer)

    group = rollout = None
    try:
        placement = place(cfg, layout)
        group = TrainerGroup(cfg, layout, placement, init_hf_dir=init_dir, total_steps=total_steps, need_ref=need_ref)
        devices = hosts = None
        if placement.engines_on_trainer_devices:
            devices = [colocated_devices(group.devices, placement.shared_ranks(i), i)
                       for i in range(cfg.rollout.num_engines)]
        if placement.hybrid:  # engine i moves into the process of the first trainer rank it shares
            hosts = [group.ranks[placement.shared_ranks(i)[0]] for i in range(cfg.rollout.num_engines)]
        eos = [tokenizer.eos_token_id]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        rollout = RolloutGroup(cfg, placement, hf_dir=init_dir, devices=devices, hosts=hosts,
                               context=EngineContext(eos_token_ids=eos, pad_token_id=pad,
                                                     log_dir=os.path.join(run_dir, "logs")))
        group.setup(cfg)
        trainer = TrainerClient(group, cfg, layout.dp)
        weights = WeightSync(cfg, trainer, rollout)
        state = RunState()
        if resume_dir is not None:
            state = checkpointer.restore(resume_dir, trainer, train_data)
            weights.sync(state.weight_version)  # engines started from the initial weights
        observer = Observer(run_dir, cfg, total_steps=total_steps,
                            resume_step=state.step if resume_dir is not None else None)
    except BaseException:
        close(None, judger, rollout, group)
        raise
    log.info("run dir %s | trainer ranks %d (tp=%d pp=%d cp=%d dp=%d) | engines %d (%s) | steps %d..%d",
             run_dir, layout.trainer_world, cfg.actor.tp, cfg.actor.pp, cfg.actor.cp, layout.dp,
             cfg.rollout.num_engines, cfg.rollout.engine, state.step, total_steps)
    return Parts(tokenizer, train_data, val_data, judger, placement, trainer, rollout, weights, checkpointer,
                 observer, state, total_steps)


def initial_weights(cfg: MGRPOConfig, run_dir: str, tokenizer) -> str:
    """The HF directory every process starts from: the user's checkpoint, or a seeded random init
    written once per run (so every TP/PP layout and the rollout engines start identical)."""
    from mgrpo.models import check_hf_config, init_hf_checkpoint

    m = cfg.model
    if m.hf_path:
        check_hf_config(m.hf_path, m)
        return m.hf_path
    path = os.path.join(run_dir, "init_hf")
    if not os.path.isfile(os.path.join(path, "config.json")):
        init_hf_checkpoint(path, m, seed=cfg.trainer.seed, tokenizer=tokenizer)
    return path


def close(observer, judger, rollout, trainer) -> None:
    """Take down whatever was built (any of them may be None after a failed start); a failure while
    shutting down is logged, never allowed to hide the failure that caused it."""
    for closer in (observer, judger):
        if closer is not None:
            closer.close()
    for part in (rollout, trainer):
        if part is not None:
            try:
                part.shutdown()
            except Exception as err:
                log.warning("shutdown of %s failed: %s", type(part).__name__, err)
    from mgrpo.cluster.ray_env import stop_ray

    stop_ray()
