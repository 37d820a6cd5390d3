"""Helpers shared by the packing and context-parallel tests (this module holds no tests itself).

Every run builds the real `MegatronActor` (megatron-core over gloo) from one random HF checkpoint and
feeds it one batch of mixed lengths: log-probs of actor and reference, one optimizer step, log-probs
again. Several layouts run one after another in the same spawned processes (megatron's parallel
state is re-initialised between them), so a comparison costs one spawn per world size.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mgrpo.config import MGRPOConfig
from tests.helpers.convert import tiny_cfg


# prompt and response lengths of the batch: mixed, long-tailed, some sharing a length
PROMPTS = [5, 3, 8, 2, 6, 4, 7, 3]
RESPONSES = [3, 17, 6, 1, 25, 9, 2, 12]


def run_config(*, tp=1, pp=1, cp=1, packed=False, budget=64, policy_loss="vanilla") -> MGRPOConfig:
    """tiny_cfg (GQA, head_dim != hidden/heads, 4 layers, vocabulary 100), fp32 on CPU, a KL term and
    an entropy bonus so every part of the loss has a gradient; `budget` cuts the batch into several
    micro-batches of different shapes."""
    cfg = MGRPOConfig()
    return dataclasses.replace(
        cfg, model=tiny_cfg(max_position_embeddings=128),
        algorithm=dataclasses.replace(cfg.algorithm, use_kl_loss=True, kl_coef=0.05, entropy_coeff=0.01,
                                      policy_loss=policy_loss),
        actor=dataclasses.replace(cfg.actor, tp=tp, pp=pp, cp=cp, pack_sequences=packed, max_tokens_per_gpu=budget,
                                  lr=1e-2, grad_clip=1e9),
        trainer=dataclasses.replace(cfg.trainer, device="cpu"))


# Equal prompts of 10 and responses of 2: under cp=2 every sample is 12 slots in chunks of 3, its
# response is predicted at positions 9 and 10, so CP rank 1 holds no response token at all.
TAIL = ([10] * 4, [2] * 4)


def make_batch(vocab: int, seed: int = 0, prompts=PROMPTS, responses=RESPONSES):
    """A RankBatch with random tokens, advantages and old log-probs, and token weights of the
    token-mean aggregation over its own tokens (as the actor client would send a single replica)."""
    from mgrpo.training.batch import RankBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (p + r,), generator=g).tolist() for p, r in zip(prompts, responses)]
    total = sum(responses)
    return RankBatch(
        input_ids=ids, prompt_lens=list(prompts), seq_index=list(range(len(ids))),
        advantages=[torch.randn(r, generator=g).tolist() for r in responses],
        old_logprobs=[(-3.0 - torch.rand(r, generator=g)).tolist() for r in responses],
        ref_logprobs=[(-3.0 - torch.rand(r, generator=g)).tolist() for r in responses],
        token_weight=[[1.0 / total] * r for r in responses], metric_weight=1.0 / total)


class Receiver:
    """Stands in for a rollout engine's weight receiver: records what arrives."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def update_weights(self, bucket):
        self.sums.update({name: float(t.double().sum()) for name, t in bucket})


def _one_run(rank, world, port, hf_dir, layout: dict):
    """`layout`: run_config arguments, plus optional `load` (a megatron checkpoint to start from),
    `save` (a directory for the trained actor's megatron checkpoint and HF export) and `tail` (the
    TAIL batch instead of the mixed one)."""
    from mgrpo.training.actor import MegatronActor

    layout = dict(layout)
    load, save, tail = layout.pop("load", None), layout.pop("save", None), layout.pop("tail", False)
    cfg = run_config(**layout)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=1, need_ref=True)
    if load:
        actor.load_checkpoint(load)
    batch = make_batch(cfg.model.vocab_size, *((1, *TAIL) if tail else ()))
    before = actor.compute_logprobs(batch, "actor")
    ref = actor.compute_logprobs(batch, "ref")
    metrics = actor.train_mini_batch(batch)
    after = actor.compute_logprobs(batch, "actor")
    receiver = Receiver()
    actor.sync_weights([receiver], bucket_bytes=1 << 16)
    if save:
        actor.save_checkpoint(save)
        actor.save_hf(save + "-hf", None)
    mbs = actor._micro_batches(batch)[0]
    return dict(info=actor.info(), metrics=metrics, before=before, ref=ref, after=after, synced=receiver.sums,
                micro_batches=[tuple(mb.tokens.shape) for mb in mbs], local_tokens=sum(mb.num_tokens for mb in mbs))


def rank_runs(rank, world, port, hf_dir, layouts):
    """Every layout in turn in this process; between them only megatron's model-parallel state is
    torn down (the gloo world stays)."""
    from megatron.core import parallel_state as ps

    out = []
    for layout in layouts:
        out.append(_one_run(rank, world, port, hf_dir, layout))
        ps.destroy_model_parallel()
    return out


def answer(results: list[dict]) -> dict:
    """The one rank's result that carries log-probs (last stage, tp_rank 0, cp_rank 0); metrics are
    the same on every rank."""
    (r,) = [r for r in results if r["before"] is not None]
    return r


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_same_run(got: dict, want: dict, tol: float = 1e-5, label: str = "") -> None:
    """Log-probs (before and after the update, and the reference's) and the step's loss metrics agree."""
    for key in ("before", "ref", "after"):
        for k in ("logprobs", "entropy") if key != "ref" else ("logprobs",):
            d = max_diff(got[key][k], want[key][k])
            assert d < tol, f"{label}: {key} {k} differ by {d}"
    assert all(e is None for e in got["ref"]["entropy"])  # nothing reads the reference's entropy: not computed
    for k in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        a, b = got["metrics"][k], want["metrics"][k]
        assert math.isfinite(a) and abs(a - b) < tol, f"{label}: {k} {a} vs {b}"
