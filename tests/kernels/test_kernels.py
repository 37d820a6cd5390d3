"""mgrpo_kernels: the chunked torch path (and the dispatcher) against the full-logits reference, fp32.

Tolerances from the kernel's contract: log-probs 1e-5, entropy 1e-4, gradient relative error 1e-4.
Shapes are tiny but chunk sizes are chosen so that every run crosses several token chunks and
vocabulary tiles, with a ragged last tile, and padded rows hold large values that would dominate
the softmax if they leaked in.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mgrpo_kernels as K
from mgrpo_kernels.reference import full_linear_loss, full_logprobs
from tests.helpers.kernels import SMALL_CHUNKS, make_problem, rel_err, leaves, grpo_fn, run_logprobs, run_loss


def assert_close_outputs(got, want, grads=True):
    lp, ent, gh, gw = got
    lp0, ent0, gh0, gw0 = want
    assert (lp - lp0).abs().max().item() < 1e-5
    if ent0 is not None:
        assert (ent - ent0).abs().max().item() < 1e-4
    if grads:
        assert rel_err(gh, gh0) < 1e-4, rel_err(gh, gh0)
        assert rel_err(gw, gw0) < 1e-4, rel_err(gw, gw0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_size", [None, 83])
def test_linear_logprobs_matches_reference(temperature, vocab_size):
    p = make_problem(vocab_size=vocab_size)
    kw = dict(temperature=temperature, vocab_size=vocab_size)
    want = run_logprobs(p, "naive", **kw)
    got = run_logprobs(p, "chunked", **kw, **SMALL_CHUNKS)
    assert_close_outputs(got, want)
    if vocab_size is not None:  # padded rows get exactly zero gradient
        assert got[3][vocab_size:].abs().max().item() == 0.0


def test_linear_logprobs_default_chunking_and_no_entropy():
    p = make_problem(T=300, V=9000)
    want = run_logprobs(p, "naive")
    assert_close_outputs(run_logprobs(p, "chunked"), want)
    h, w = leaves(p)
    lp, ent = K.linear_logprobs(h, w, p["labels"], compute_entropy=False, **SMALL_CHUNKS)
    assert ent is None
    lp.sum().backward()
    h0, w0 = leaves(p)
    full_logprobs(h0, w0, p["labels"], compute_entropy=False)[0].sum().backward()
    assert rel_err(h.grad, h0.grad) < 1e-4 and rel_err(w.grad, w0.grad) < 1e-4


@pytest.mark.parametrize("kl_loss_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
@pytest.mark.parametrize("temperature,vocab_size", [(1.0, None), (0.7, 83)])
def test_fused_linear_loss_matches_reference(kl_loss_type, clip_ratio_c, temperature, vocab_size):
    p = make_problem(vocab_size=vocab_size, seed=1)
    fn = grpo_fn(p, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c,
                 kl_loss_type=kl_loss_type, kl_coef=0.1, entropy_coeff=0.01)
    kw = dict(temperature=temperature, vocab_size=vocab_size)
    loss0, m0, lp0, ent0, gh0, gw0 = run_loss(p, "naive", fn, **kw)
    loss, m, lp, ent, gh, gw = run_loss(p, "chunked", fn, **kw, **SMALL_CHUNKS)
    assert abs(loss.item() - loss0.item()) < 1e-5
    assert set(m) == set(m0) and all(abs(m[k].item() - m0[k].item()) < 1e-5 for k in m0)
    assert m0["actor/pg_clipfrac"].item() > 0  # the test really exercises clipping...
    if clip_ratio_c is not None:
        assert m0["actor/pg_clipfrac_lower"].item() > 0  # ... and the dual clip
    assert not lp.requires_grad and not ent.requires_grad
    assert_close_outputs((lp, ent, gh, gw), (lp0, ent0, gh0, gw0))


def test_fused_backward_scales_by_grad_output_and_masks_tokens():
    p = make_problem(seed=2)
    fn = grpo_fn(p, kl_loss_type="low_var_kl", kl_coef=0.05, entropy_coeff=0.02)
    *_, gh0, gw0 = run_loss(p, "naive", fn, scale=3.0)
    *_, gh, gw = run_loss(p, "chunked", fn, scale=3.0, **SMALL_CHUNKS)
    assert rel_err(gh, gh0) < 1e-4 and rel_err(gw, gw0) < 1e-4
    assert gh[~p["mask"]].abs().max().item() == 0.0  # zero-weight tokens contribute nothing


def test_fused_adds_the_weight_grad_to_a_main_grad_buffer_beside_a_tied_embedding():
    """grad_weight_into with grad_scale (Megatron's gradient-accumulation fusion, in the forward): with the weight
    tied to an embedding and the loss scaled as announced, buffer + autograd's grad equal the reference's whole
    gradient, and autograd's share is the embedding's alone (the kernel's dWeight never reaches autograd)."""
    from tests.helpers.kernels import run_tied_loss

    p = make_problem(seed=5)
    fn = grpo_fn(p, kl_loss_type="low_var_kl", kl_coef=0.05, entropy_coeff=0.02)
    want, _ = run_tied_loss(p, "naive", fn)
    got, autograd_part = run_tied_loss(p, "chunked", fn, into=True, **SMALL_CHUNKS)
    assert rel_err(got, want) < 1e-4, rel_err(got, want)
    plain, _ = run_tied_loss(p, "chunked", fn, **SMALL_CHUNKS)
    assert rel_err(plain, want) < 1e-4
    kernel_part = plain - autograd_part  # what the kernel sent: large, and absent from autograd's share
    assert kernel_part.abs().max().item() > 1e-2 and rel_err(got - autograd_part, kernel_part) < 1e-4
    h, w = leaves(p)
    for bad in (torch.zeros(w.shape, dtype=torch.float64), torch.zeros(3, 4)):
        with pytest.raises(ValueError, match="grad_weight_into must be a float32 tensor of the weight's shape"):
            K.fused_linear_loss(h, w, p["labels"], fn, grad_weight_into=bad, grad_scale=1.0)
    with pytest.raises(ValueError, match="grad_weight_into needs grad_scale"):
        K.fused_linear_loss(h, w, p["labels"], fn, grad_weight_into=torch.zeros(w.shape))
    with pytest.raises(ValueError, match="naive oracle"):
        K.fused_linear_loss(h, w, p["labels"], fn, impl="naive", grad_weight_into=torch.zeros(w.shape), grad_scale=1.0)
    # a loss that receives another gradient than announced fails in the backward (dWeight is already in the buffer)
    loss, *_ = K.fused_linear_loss(h, w, p["labels"], fn, grad_weight_into=torch.zeros(w.shape), grad_scale=2.0)
    with pytest.raises(RuntimeError, match=r"received gradient 3\.0 but grad_scale=2\.0 was announced"):
        (3.0 * loss).backward()


def test_fused_without_entropy_and_with_frozen_weight():
    p = make_problem(seed=3)
    fn = grpo_fn(p, kl_loss_type="k1", kl_coef=0.1, entropy_coeff=0.0)
    h = p["hidden"].clone().requires_grad_()
    loss, metrics, lp, ent = K.fused_linear_loss(h, p["weight"], p["labels"], fn, compute_entropy=False,
                                                 **SMALL_CHUNKS)
    loss.backward()
    assert ent is None and "actor/entropy" not in metrics
    h0 = p["hidden"].clone().requires_grad_()
    full_linear_loss(h0, p["weight"], p["labels"], fn, compute_entropy=False)[0].backward()
    assert rel_err(h.grad, h0.grad) < 1e-4


def test_chunked_bf16_inputs_keep_fp32_statistics():
    p = make_problem(seed=4)
    lp0, ent0, _, _ = run_logprobs(p, "naive")
    pb = make_problem(seed=4, dtype=torch.bfloat16)
    lp, ent, gh, gw = run_logprobs(pb, "chunked", **SMALL_CHUNKS)
    assert lp.dtype == ent.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    assert (lp - lp0).abs().max().item() < 0.1 and (ent - ent0).abs().max().item() < 0.1


def test_dispatch_errors(monkeypatch):
    p = make_problem()
    with pytest.raises(ValueError, match="actor.logprob_impl"):
        K.linear_logprobs(p["hidden"], p["weight"], p["labels"], impl="flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"actor\.logprob_impl=fused.*CUDA device"):
            K.linear_logprobs(p["hidden"], p["weight"], p["labels"], impl="fused")
        assert K.capabilities()["fused"] is False


@pytest.mark.integration
def test_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, mgrpo_kernels as K\n"
        "caps = K.capabilities(); assert caps['triton'] is None and not caps['fused'], caps\n"
        "h, w = torch.randn(5, 8), torch.randn(11, 8); lp, ent = K.linear_logprobs(h, w, torch.arange(5))\n"
        "assert lp.shape == ent.shape == (5,)\n"
        "try:\n    K.linear_logprobs(h, w, torch.arange(5), impl='fused')\nexcept RuntimeError as e:\n"
        "    assert 'triton package' in str(e), e\nelse:\n    raise SystemExit('fused did not refuse')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
