"""Vocabulary-parallel (TP=2, gloo) log-probs and fused loss equal TP=1, padded rows included.

Each rank holds half of a padded vocabulary. Case "padded": 64 rows, 45 real, so rank 1 owns 13
real and 19 padding rows. Case "empty shard": 30 real, so rank 1 owns padding only and must still
take part in every all-reduce. The fused Triton path runs the same way under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.kernels import SMALL_CHUNKS, grpo_fn, make_problem, rel_err

CASES = {"padded": (64, 45), "empty_shard": (64, 30)}
LOSS_CFG = dict(clip_ratio_c=3.0, kl_loss_type="low_var_kl", kl_coef=0.1, entropy_coeff=0.01)


def _tp_rank(rank, world, port, impls):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this fresh process
    import torch.distributed as dist

    import mgrpo_kernels as K

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))  # passed explicitly, as Megatron's TP group would be
    out = {}
    for case, (v_pad, v_real) in CASES.items():
        p = make_problem(V=v_pad, vocab_size=v_real)
        rows = v_pad // world
        shard = slice(rank * rows, (rank + 1) * rows)
        tp = dict(tp_group=group, vocab_start=rank * rows, vocab_size=v_real, temperature=0.7)
        for impl in impls:
            chunks = SMALL_CHUNKS if impl == "chunked" else {}
            h = p["hidden"].clone().requires_grad_()
            w = p["weight"][shard].clone().requires_grad_()
            lp, ent = K.linear_logprobs(h, w, p["labels"], impl=impl, **tp, **chunks)
            (lp.sum() + 0.5 * ent.sum()).backward()
            out[case, impl, "logprobs"] = (lp.detach(), ent.detach(), h.grad, w.grad)
            h = p["hidden"].clone().requires_grad_()
            w = p["weight"][shard].clone().requires_grad_()
            loss, metrics, lp, ent = K.fused_linear_loss(h, w, p["labels"], grpo_fn(p, **LOSS_CFG), impl=impl,
                                                         **tp, **chunks)
            loss.backward()
            out[case, impl, "loss"] = (lp, ent, h.grad, w.grad, loss.detach(), metrics)
    dist.destroy_process_group()
    # Plain numpy arrays: torch tensors would travel as shared-memory handles that die with the rank.
    return {k: _to_numpy(v) for k, v in out.items()}


def _to_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().copy()
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    return tuple(_to_numpy(v) for v in x)


def _to_torch(x):
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_to_torch(v) for v in x)
    return torch.from_numpy(x)


def _tp1(case):
    import mgrpo_kernels as K

    v_pad, v_real = CASES[case]
    p = make_problem(V=v_pad, vocab_size=v_real)
    kw = dict(vocab_size=v_real, temperature=0.7, **SMALL_CHUNKS)
    h, w = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    lp, ent = K.linear_logprobs(h, w, p["labels"], **kw)
    (lp.sum() + 0.5 * ent.sum()).backward()
    want = {"logprobs": (lp.detach(), ent.detach(), h.grad, w.grad)}
    h, w = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    loss, metrics, lp, ent = K.fused_linear_loss(h, w, p["labels"], grpo_fn(p, **LOSS_CFG), **kw)
    loss.backward()
    want["loss"] = (lp, ent, h.grad, w.grad, loss.detach(), metrics)
    return want, v_pad // 2


def _check(results, impls):
    for case in CASES:
        want, rows = _tp1(case)
        for impl in impls:
            for kind in ("logprobs", "loss"):
                for rank, res in enumerate(results):
                    lp, ent, gh, gw, *rest = _to_torch(res[case, impl, kind])
                    lp0, ent0, gh0, gw0, *rest0 = want[kind]
                    where = f"{case}/{impl}/{kind}/rank{rank}"
                    assert (lp - lp0).abs().max().item() < 1e-5, where
                    assert (ent - ent0).abs().max().item() < 1e-4, where
                    assert rel_err(gh, gh0) < 1e-4, where  # dHidden all-reduced over the group
                    gw0_shard = gw0[rank * rows : (rank + 1) * rows]
                    if gw0_shard.abs().max() == 0:  # a shard of padding only: exact zeros
                        assert gw.abs().max().item() == 0.0, where
                    else:
                        assert rel_err(gw, gw0_shard) < 1e-4, where
                    if kind == "loss":
                        assert abs(rest[0].item() - rest0[0].item()) < 1e-5, where
                        assert all(abs(rest[1][k].item() - rest0[1][k].item()) < 1e-5 for k in rest0[1]), where


@pytest.mark.integration
def test_tp2_equals_tp1_chunked_and_naive():
    impls = ("chunked", "naive")
    _check(run_ranks(_tp_rank, 2, impls, timeout_s=120), impls)


@pytest.mark.integration
def test_tp2_equals_tp1_triton_interpreted():
    pytest.importorskip("triton")
    impls = ("fused",)
    _check(run_ranks(_tp_rank, 2, impls, timeout_s=120), impls)
