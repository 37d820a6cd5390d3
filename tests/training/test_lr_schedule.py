"""The LR schedule counts optimizer steps: warm-up and decay are given in RL steps (veRL's unit) and
span updates_per_step = ppo_epochs x train_batch_size / ppo_mini_batch_size optimizer steps each.

The reference is the closed form of linear warm-up from 0 followed by linear or cosine decay to min_lr,
written out here independently of megatron's OptimizerParamScheduler."""

from __future__ import annotations

import math

import pytest
import torch

from mgrpo.config import MGRPOConfig
from tests.helpers.distributed import run_ranks

LR, MIN_LR = 1e-3, 1e-4


def closed_form(k: int, *, warmup: int, decay: int, style: str) -> float:
    """LR of optimizer update k (0-based): linear warm-up from 0 over `warmup` updates, then decay to
    MIN_LR at update `decay`."""
    if warmup > 0 and k <= warmup:
        return LR * k / warmup
    ratio = (k - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return MIN_LR + coeff * (LR - MIN_LR)


def run_config(style: str, **actor) -> MGRPOConfig:
    cfg = MGRPOConfig()
    cfg.data.train_batch_size = 4
    cfg.actor.ppo_mini_batch_size = 2          # 2 mini-batches per RL step
    cfg.actor.ppo_epochs = 2                   # x 2 epochs = 4 optimizer steps per RL step
    cfg.actor.lr, cfg.actor.min_lr, cfg.actor.lr_decay_style = LR, MIN_LR, style
    cfg.actor.lr_warmup_steps = 1              # RL steps
    cfg.algorithm.use_kl_loss = False
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


def test_optimizer_steps_per_step():
    from mgrpo.training.optim import optimizer_steps_per_step

    cfg = run_config("linear")
    assert optimizer_steps_per_step(cfg) == 4
    cfg.actor.ppo_mini_batch_size = None       # one mini-batch = the whole batch
    assert optimizer_steps_per_step(cfg) == 2
    cfg.actor.ppo_epochs, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size = 3, 32, 8
    assert optimizer_steps_per_step(cfg) == 12


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_scheduler_counts_optimizer_steps(style):
    """build_scheduler over a plain torch optimizer (megatron's scheduler only reads param_groups)."""
    from mgrpo.training.optim import build_scheduler

    cfg = run_config(style)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    total_rl_steps, per_step = 3, 4
    sched = build_scheduler(cfg.actor, opt, total_rl_steps, per_step)
    assert (sched.lr_warmup_steps, sched.lr_decay_steps) == (4, 12)
    for k in range(total_rl_steps * per_step + 2):  # past the end: stays at min_lr
        want = closed_form(k, warmup=4, decay=12, style=style) if k <= 12 else MIN_LR
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), k
        sched.step(increment=1)


def _actor_lrs(rank, world, port, hf_dir, total_rl_steps):
    """Build the real MegatronActor (megatron optimizer + scheduler) and run one train_mini_batch per
    update; return the LR each update ran with and the scheduler's sizes."""
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch
    from mgrpo.training.optim import optimizer_steps_per_step

    cfg = run_config("cosine")
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=total_rl_steps, need_ref=False)
    resp = 3
    batch = RankBatch(input_ids=[[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], prompt_lens=[2, 2],
                      advantages=[[1.0] * resp, [-1.0] * resp], old_logprobs=[[-2.0] * resp] * 2,
                      token_weight=[[1 / (2 * resp)] * resp] * 2, metric_weight=1 / (2 * resp))
    lrs, reported = [], []
    for _ in range(total_rl_steps * optimizer_steps_per_step(cfg)):
        lrs.append(actor.optimizer.param_groups[0]["lr"])
        reported.append(actor.train_mini_batch(batch)["actor/lr"])
    sizes = (actor.scheduler.lr_warmup_steps, actor.scheduler.lr_decay_steps, actor.skipped_steps)
    actor.shutdown()
    return lrs, reported, sizes


@pytest.mark.integration
def test_actor_steps_the_schedule_once_per_update(tmp_path):
    """3 RL steps x (2 mini-batches x 2 epochs): warm-up over the first 4 updates, cosine decay to
    min_lr at update 12. (Sized in RL steps, as before the fix, warm-up ended after 1 update and the
    LR hit min_lr after 3 of the 12.)"""
    from mgrpo.models import init_hf_checkpoint

    cfg = run_config("cosine")
    init_hf_checkpoint(str(tmp_path / "init"), cfg.model, seed=1)
    lrs, reported, (warmup, decay, skipped) = run_ranks(_actor_lrs, 1, str(tmp_path / "init"), 3)[0]
    assert (warmup, decay, skipped) == (4, 12, 0)
    want = [closed_form(k, warmup=4, decay=12, style="cosine") for k in range(12)]
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)
    # actor/lr is read after the step: the LR the next update will use
    assert reported == pytest.approx(want[1:] + [MIN_LR], rel=1e-12)
