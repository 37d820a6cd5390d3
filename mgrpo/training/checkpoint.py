"""Resumable trainer checkpoints in megatron's distributed format.

Weights and optimizer moments are saved as sharded tensors (each rank writes its shards; a checkpoint
loads at the layout it was written with and, for weights, at any other). The learning-rate schedule
and counters ride along as common state. No pickles of arbitrary objects are loaded: megatron's
torch_dist format stores tensors plus plain metadata.
"""

from __future__ import annotations

import os

from mgrpo.training.optim import use_fused_torch_adam


def _sharded(actor, *, is_loading: bool) -> dict:
    model_sd = actor.gpt.sharded_state_dict()
    # is_loading makes the optimizer create its (still empty) Adam moments first, so that the
    # template has a place for every tensor being loaded.
    return {"model": model_sd, "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _expert_parallel(actor) -> bool:
    """megatron gives experts an optimizer of their own (a ChainedOptimizer) only when ep > 1: the optimizer
    state of an EP > 1 run and of an EP = 1 run do not load into each other (other EP sizes do)."""
    return actor.ctx.ep > 1


def save_checkpoint(actor, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    state = _sharded(actor, is_loading=False)
    state["scheduler"] = actor.scheduler.state_dict()
    state["skipped_steps"] = actor.skipped_steps
    if actor.cfg.model.num_experts:
        state["expert_parallel"] = _expert_parallel(actor)
    dist_checkpointing.save(state, ckpt_dir)


def load_checkpoint(actor, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"no megatron checkpoint at {ckpt_dir}")
    if actor.cfg.model.num_experts:
        saved = dist_checkpointing.load_common_state_dict(ckpt_dir).get("expert_parallel")
        if saved is not None and saved != _expert_parallel(actor):
            raise ValueError(f"{ckpt_dir} was written with actor.ep {'> 1' if saved else '= 1'} and cannot resume at "
                             f"actor.ep={actor.ctx.ep}: megatron keeps experts in an optimizer of their own only "
                             "when ep > 1 (resume with an actor.ep on the same side of 1)")
    template = _sharded(actor, is_loading=True)
    template["scheduler"] = actor.scheduler.state_dict()
    template["skipped_steps"] = 0
    state = dist_checkpointing.load(template, ckpt_dir)
    actor.gpt.load_state_dict(state["model"])
    actor.optimizer.load_state_dict(state["optimizer"])
    use_fused_torch_adam(actor.optimizer)  # the checkpoint's param groups replaced the options: the same kernel
    actor.scheduler.load_state_dict(state["scheduler"])
    actor.skipped_steps = int(state["skipped_steps"])


def load_model_weights(gpt, ckpt_dir: str) -> None:
    """The model weights alone of a checkpoint `save_checkpoint` wrote (its optimizer and schedule are left on
    disk): what `mgrpo-doctor layers --trainer <run>/checkpoints/step_N` loads."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"no megatron checkpoint at {ckpt_dir}")
    state = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, ckpt_dir,
                                    strict=StrictHandling.RAISE_UNEXPECTED)
    gpt.load_state_dict(state["model"])
