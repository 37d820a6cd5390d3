"""The Triton kernels (impl="fused") against the reference, on CPU under TRITON_INTERPRET=1, fp32.

TRITON_INTERPRET must be set before triton is first imported, and setting it in this pytest process
would leak into every other test, so one subprocess runs all scenarios and reports its measured
errors as JSON; the tests below assert on those numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytest.importorskip("triton")

LOGPROB_CASES = [(t, v) for t in (1.0, 0.7) for v in (None, 83)]
LOSS_CASES = [(kl, c) for kl in ("k1", "k2", "k3", "low_var_kl") for c in (None, 3.0)]


def _child() -> None:
    import mgrpo_kernels as K
    from tests.helpers.kernels import grpo_fn, make_problem, rel_err, run_logprobs, run_loss

    def errs(got, want):
        out = {"lp": (got[0] - want[0]).abs().max().item(), "gh": rel_err(got[2], want[2]),
               "gw": rel_err(got[3], want[3])}
        if want[1] is not None:
            out["ent"] = (got[1] - want[1]).abs().max().item()
        return out

    res = {}
    for t, v in LOGPROB_CASES:
        p = make_problem(vocab_size=v)
        kw = dict(temperature=t, vocab_size=v)
        res[f"logprobs/{t}/{v}"] = errs(run_logprobs(p, "fused", **kw), run_logprobs(p, "naive", **kw))
    for kl, c in LOSS_CASES:
        p = make_problem(vocab_size=83, seed=1)
        fn = grpo_fn(p, clip_ratio_c=c, kl_loss_type=kl, kl_coef=0.1, entropy_coeff=0.01)
        kw = dict(temperature=0.7, vocab_size=83)
        loss0, m0, *want = run_loss(p, "naive", fn, scale=2.0, **kw)
        loss, m, *got = run_loss(p, "fused", fn, scale=2.0, **kw)
        e = errs(got, want)
        e["loss"] = abs(loss.item() - loss0.item())
        e["metrics"] = max(abs(m[k].item() - m0[k].item()) for k in m0) if set(m) == set(m0) else 1.0
        res[f"loss/{kl}/{c}"] = e
    p = make_problem(seed=3)
    h = p["hidden"].clone().requires_grad_()
    no_entropy = grpo_fn(p, kl_coef=0.1, entropy_coeff=0.0)
    loss, metrics, lp, ent = K.fused_linear_loss(h, p["weight"], p["labels"], no_entropy, compute_entropy=False,
                                                 impl="fused")
    loss.backward()
    h0 = p["hidden"].clone().requires_grad_()
    K.fused_linear_loss(h0, p["weight"], p["labels"], no_entropy, compute_entropy=False, impl="naive")[0].backward()
    res["frozen_weight_no_entropy"] = {"gh": rel_err(h.grad, h0.grad), "ent_is_none": float(ent is not None)}
    from tests.helpers.kernels import run_tied_loss

    p = make_problem(seed=5)
    fn = grpo_fn(p, kl_loss_type="low_var_kl", kl_coef=0.05)
    want, _ = run_tied_loss(p, "naive", fn)
    got, _ = run_tied_loss(p, "fused", fn, into=True)
    res["grad_weight_into_tied"] = {"gw": rel_err(got, want)}
    print("RESULTS" + json.dumps(res))


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", "from tests.kernels.test_kernels_triton import _child; _child()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


def _assert_within(e):
    assert e["lp"] < 1e-5 and e["gh"] < 1e-4 and e["gw"] < 1e-4, e
    assert e.get("ent", 0.0) < 1e-4, e


@pytest.mark.integration
@pytest.mark.parametrize("temperature,vocab_size", LOGPROB_CASES)
def test_triton_linear_logprobs(results, temperature, vocab_size):
    _assert_within(results[f"logprobs/{temperature}/{vocab_size}"])


@pytest.mark.integration
@pytest.mark.parametrize("kl_loss_type,clip_ratio_c", LOSS_CASES)
def test_triton_fused_loss(results, kl_loss_type, clip_ratio_c):
    e = results[f"loss/{kl_loss_type}/{clip_ratio_c}"]
    _assert_within(e)
    assert e["loss"] < 1e-5 and e["metrics"] < 1e-5, e


@pytest.mark.integration
def test_triton_frozen_weight_without_entropy(results):
    e = results["frozen_weight_no_entropy"]
    assert e["gh"] < 1e-4 and e["ent_is_none"] == 0.0, e


@pytest.mark.integration
def test_triton_adds_the_weight_grad_to_a_main_grad_buffer(results):
    e = results["grad_weight_into_tied"]
    assert e["gw"] < 1e-4, e
