"""The actor's optimizer on CPU: megatron falls back to torch's AdamW there and mgrpo runs it with torch's fused
kernel (training/optim.py::use_fused_torch_adam). The update is checked against AdamW's closed form for its first
step (bias-corrected moments of one gradient: m_hat = g, v_hat = g^2), written out here."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.training.test_lr_schedule import run_config


def _first_update(rank, world, port, hf_dir, ckpt_dir):
    import torch

    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch
    from mgrpo.training.checkpoint import load_checkpoint, save_checkpoint
    from mgrpo.training.optim import torch_optimizers

    cfg = run_config("constant", grad_clip=0.0, weight_decay=0.1, lr_warmup_steps=0)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=2, need_ref=False)
    (opt,) = torch_optimizers(actor.optimizer)
    params = [(p, g) for g in opt.param_groups for p in g["params"]]  # each with its group (norms: no decay)
    before = [p.detach().clone() for p, _ in params]
    resp = 3
    batch = RankBatch(input_ids=[[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]], prompt_lens=[2, 2],
                      advantages=[[1.0] * resp, [-1.0] * resp], old_logprobs=[[-2.0] * resp] * 2,
                      token_weight=[[1 / (2 * resp)] * resp] * 2, metric_weight=1 / (2 * resp))
    actor.train_mini_batch(batch)
    worst, moved = 0.0, 0
    for p0, (p, group) in zip(before, params):
        lr, wd, (b1, _), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        g = opt.state[p]["exp_avg"] / (1 - b1)  # the step's gradient: m_1 = (1 - b1) g
        want = p0 * (1 - lr * wd) - lr * g / (g.abs() + eps)
        worst = max(worst, (p.detach() - want).abs().max().item())
        moved += int(not torch.equal(p0, p.detach()))
    fused = [g["fused"] for g in opt.param_groups]
    save_checkpoint(actor, ckpt_dir)
    for g in opt.param_groups:  # what a checkpoint written before this change holds
        g["fused"] = None
    load_checkpoint(actor, ckpt_dir)
    fused_after_load = [g["fused"] for g in (torch_optimizers(actor.optimizer)[0]).param_groups]
    paths = actor.info()["paths"]
    actor.shutdown()
    return fused, fused_after_load, worst, moved, len(params), opt.param_groups[0]["lr"], paths


@pytest.mark.integration
def test_cpu_actor_steps_torch_fused_adamw_and_keeps_it_across_a_checkpoint(tmp_path):
    from mgrpo.models import init_hf_checkpoint

    cfg = run_config("constant")
    init_hf_checkpoint(str(tmp_path / "init"), cfg.model, seed=1)
    fused, after_load, worst, moved, n, lr, paths = run_ranks(_first_update, 1, str(tmp_path / "init"),
                                                              str(tmp_path / "ckpt"))[0]
    assert fused and all(fused) and all(after_load), (fused, after_load)
    assert moved == n  # every parameter took the step
    assert worst < 1e-3 * lr, worst  # AdamW's first step to float32 rounding (each element moves by ~lr)
    assert "torch.optim.adamw.AdamW optimizer (torch's fused kernel)" in paths, paths
