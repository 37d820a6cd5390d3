"""Top-k log-probs (a distillation teacher's) and log-probs of given ids (the student's) against a dense torch
computation from full logits: values, chosen ids, and the gradients of veRL's forward_kl_topk term; TP=2 (gloo)
top-k against TP=1 with a padded vocabulary and a shard of padding only."""

from __future__ import annotations

import pytest
import torch

import mgrpo_kernels as K
from mgrpo.algorithms.distill import forward_kl_topk
from mgrpo.config.teacher import OpdConfig
from tests.helpers.distributed import run_ranks

T, H, V_PAD, V_REAL = 13, 8, 24, 21


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(V_PAD, H, generator=g)


def _dense_logp(h, w, temperature):
    return torch.log_softmax((h @ w[:V_REAL].T) / temperature, -1)


@pytest.mark.parametrize("k", [1, 5, V_REAL])
def test_topk_equals_dense_log_softmax_topk(k):
    h, w = _problem()
    lp, ids = K.linear_topk(h, w, k, temperature=0.7, chunk_size=4, vocab_size=V_REAL)
    want_lp, want_ids = _dense_logp(h, w, 0.7).topk(k, -1)
    assert torch.equal(ids, want_ids)
    assert (lp - want_lp).abs().max().item() < 1e-5
    assert int(ids.max()) < V_REAL  # padding rows are never chosen


def test_more_than_the_vocabulary_is_refused():
    h, w = _problem()
    with pytest.raises(ValueError, match="top-22 of a vocabulary of 21"):
        K.linear_topk(h, w, 22, vocab_size=V_REAL)


@pytest.mark.parametrize("impl", ["chunked", "naive"])
def test_forward_kl_topk_term_and_gradients_equal_a_dense_reference(impl):
    """The student's log-probs of the teacher's top-k ids through the kernel, veRL's per-token term and its
    gradients w.r.t. hidden and weight, against the same term from full-vocabulary log_softmax and autograd."""
    h0, w0 = _problem(1)
    th, tw = _problem(2)  # the teacher: other weights, its own top 6 per token
    teacher_lp, teacher_ids = K.linear_topk(th, tw, 6, temperature=0.7, vocab_size=V_REAL)
    weights = torch.rand(T, generator=torch.Generator().manual_seed(3))
    weights[2] = 0.0  # a token out of the loss
    cfgs = [OpdConfig(), OpdConfig(log_prob_min_clamp=-3.0, loss_max_clamp=0.4)]
    for cfg in cfgs:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        student = K.linear_ids_logprobs(h, w, teacher_ids, temperature=0.7, impl=impl, chunk_size=5,
                                        vocab_size=V_REAL)
        loss = (weights * forward_kl_topk(student, teacher_lp, cfg)).sum()
        loss.backward()

        hd, wd = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        s = _dense_logp(hd, wd, 0.7).gather(-1, teacher_ids)
        t = teacher_lp
        if cfg.log_prob_min_clamp is not None:
            s, t = s.clamp_min(cfg.log_prob_min_clamp), t.clamp_min(cfg.log_prob_min_clamp)
        per = (t.exp() * (t - s)).sum(-1)
        if cfg.loss_max_clamp is not None:
            per = per.clamp_max(cfg.loss_max_clamp)
        want = (weights * per.clamp_min(0.0)).sum()
        want.backward()
        assert abs(loss.item() - want.item()) < 1e-5
        assert (h.grad - hd.grad).abs().max().item() < 1e-5
        assert (w.grad - wd.grad).abs().max().item() < 1e-5
    assert (per >= 0.4 - 1e-6).any()  # the clamped case: some token hit the 0.4 ceiling


def _tp_rank(rank, world, port, cases):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    h, w = _problem()
    rows = V_PAD // world
    out = {}
    for real, k in cases:
        lp, ids = K.linear_topk(h, w[rank * rows:(rank + 1) * rows], k, temperature=0.7, chunk_size=4,
                                tp_group=group, vocab_start=rank * rows, vocab_size=real)
        out[real, k] = (lp.tolist(), ids.tolist())
    dist.destroy_process_group()
    return out


@pytest.mark.integration
def test_topk_tp2_equals_dense():
    cases = [(V_REAL, 5), (V_REAL, 15), (10, 4)]  # 10 real tokens: rank 1 holds padding only
    for res in run_ranks(_tp_rank, 2, cases, timeout_s=120):
        for real, k in cases:
            h, w = _problem()
            want_lp, want_ids = torch.log_softmax((h @ w[:real].T) / 0.7, -1).topk(k, -1)
            lp, ids = (torch.tensor(x) for x in res[real, k])
            assert torch.equal(ids, want_ids), (real, k)
            assert (lp - want_lp).abs().max().item() < 1e-5, (real, k)
