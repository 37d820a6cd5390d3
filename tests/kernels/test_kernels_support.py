"""Support-aware log-probs (algorithm.logprob_support=sampled): each token's softmax, log-prob and entropy
over its own sampling support, against the full-logits reference twin, fp32, within 1e-5.

The twin itself is checked against a per-token log_softmax over the support's logits. The supports are
laid out so that every way the kernels handle a chunk of tokens is crossed (16-token chunks): a chunk
whose support union is small (gathered weight rows), one that mixes 'full' tokens (empty rows: the whole
vocabulary) with small supports (every row, masked), one of large nuclei (every row, masked), tokens
whose support lies entirely in the low or the high half of the vocabulary (one TP shard each under
TP=2), supports straddling the shard boundary, and fully 'full' tokens. The Triton kernels run under
TRITON_INTERPRET=1 in a subprocess (as tests/kernels/test_kernels_triton.py), TP=2 over gloo in spawned ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import mgrpo_kernels as K
from mgrpo_kernels.reference import full_logprobs
from mgrpo_kernels.support import chunk_columns, support_mask
from tests.helpers import ROOT
from tests.helpers.distributed import run_ranks
from tests.helpers.kernels import SMALL_CHUNKS, grpo_fn, make_problem

TOL = 1e-5
LOSS_CFG = dict(clip_ratio_c=3.0, kl_loss_type="low_var_kl", kl_coef=0.1, entropy_coeff=0.01)
CASES = [(1.0, None), (0.7, 83)]  # (temperature, vocab_size) of a 96-row output layer


def support_problem(T=64, H=32, V=96, vocab_size=None, seed=0):
    """make_problem's tensors plus a CSR support per token (see the module doc for the layout)."""
    p = make_problem(T=T, H=H, V=V, vocab_size=vocab_size, seed=seed)
    real = V if vocab_size is None else vocab_size
    half = V // 2 if real > V // 2 else real // 2  # the TP=2 shard boundary (or a split of the real rows)
    g = torch.Generator().manual_seed(seed + 100)
    labels, mask = p["labels"], p["mask"]
    pool = [1, 2, real - 2, real - 1]  # ids at both ends of the vocabulary: on both TP shards

    def subset(lo, hi, k, must):
        ids = set((lo + torch.randperm(hi - lo, generator=g)[:k]).tolist())
        return sorted(ids | ({must} if must is not None else set()))

    rows = []
    for t in range(T):
        lab = int(labels[t]) if mask[t] else None
        if t < 16:  # small union: two ids of the pool each
            if mask[t]:
                labels[t] = lab = pool[t % 4]
            rows.append(sorted({pool[t % 4], pool[(t + 1) % 4]}))
        elif t < 32:  # 'full' tokens among small random supports
            rows.append([] if t % 4 == 0 else subset(0, real, int(torch.randint(1, 7, (1,), generator=g)), lab))
        elif t < 48:  # large nuclei
            rows.append(subset(0, real, int(0.7 * real), lab))
        elif t < 56:  # entirely on the high shard
            if mask[t]:
                labels[t] = lab = int(torch.randint(half, real, (1,), generator=g))
            rows.append(subset(half, real, 3, lab))
        elif t < 60:  # entirely on the low shard
            if mask[t]:
                labels[t] = lab = int(torch.randint(0, half, (1,), generator=g))
            rows.append(subset(0, half, 3, lab))
        else:
            rows.append([])
    p["offsets"] = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    p["ids"] = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    return p


def support_kw(p):
    return dict(support_offsets=p["offsets"], support_ids=p["ids"])


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def run_logprobs(p, impl, **kw):
    h, w = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    lp, ent = K.linear_logprobs(h, w, p["labels"], impl=impl, **kw)
    c = torch.linspace(-1.0, 1.0, lp.shape[0])  # any downstream use of both outputs
    (c * lp + 0.5 * c.flip(0) * ent).sum().backward()
    return [lp.detach(), ent.detach(), h.grad, w.grad]


def run_loss(p, impl, **kw):
    h, w = p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()
    loss, metrics, lp, ent = K.fused_linear_loss(h, w, p["labels"], grpo_fn(p, **LOSS_CFG), impl=impl, **kw)
    (2.0 * loss).backward()
    return [lp, ent, h.grad, w.grad, loss.detach()], metrics


def errors(got, want) -> list[float]:
    return [max_err(a, b) for a, b in zip(got, want)]


# --- the reference twin --------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,vocab_size", CASES)
def test_reference_is_log_softmax_over_each_support(temperature, vocab_size):
    p = support_problem(vocab_size=vocab_size)
    lp, ent = full_logprobs(p["hidden"], p["weight"], p["labels"], temperature=temperature, vocab_size=vocab_size,
                            **support_kw(p))
    logits = (p["hidden"] @ p["weight"][: vocab_size or 96].T).double() / temperature
    off, ids = p["offsets"], p["ids"]
    for t in range(len(off) - 1):
        support = ids[off[t]:off[t + 1]]
        z = logits[t] if support.numel() == 0 else logits[t, support]
        logp = torch.log_softmax(z, -1)
        assert abs(ent[t].item() + (logp.exp() * logp).sum().item()) < TOL, t
        lab = int(p["labels"][t])
        if lab >= 0:
            at = lab if support.numel() == 0 else support.tolist().index(lab)
            assert abs(lp[t].item() - logp[at].item()) < TOL, t
    # truncation matters here: the support log-probs differ from the full ones
    full, _ = full_logprobs(p["hidden"], p["weight"], p["labels"], temperature=temperature, vocab_size=vocab_size)
    assert max_err(lp, full) > 0.1


# --- chunked (the CPU production path) --------------------------------------------------------------

@pytest.mark.parametrize("temperature,vocab_size", CASES)
def test_chunked_logprobs_and_grads_match_reference(temperature, vocab_size):
    p = support_problem(vocab_size=vocab_size)
    kw = dict(temperature=temperature, vocab_size=vocab_size, **support_kw(p))
    want = run_logprobs(p, "naive", **kw)
    got = run_logprobs(p, "chunked", **kw, **SMALL_CHUNKS)
    assert max(errors(got, want)) < TOL, errors(got, want)
    if vocab_size is not None:  # padding rows: exactly no gradient
        assert got[3][vocab_size:].abs().max().item() == 0.0
    # rows in no token's support (nor any 'full' token's vocabulary) get no gradient either
    assert want[3].abs().sum(-1).gt(0).sum() > 0


@pytest.mark.parametrize("temperature,vocab_size", CASES)
def test_chunked_fused_loss_matches_reference(temperature, vocab_size):
    p = support_problem(vocab_size=vocab_size, seed=1)
    kw = dict(temperature=temperature, vocab_size=vocab_size, **support_kw(p))
    want, m0 = run_loss(p, "naive", **kw)
    got, m = run_loss(p, "chunked", **kw, **SMALL_CHUNKS)
    assert max(errors(got, want)) < TOL, errors(got, want)
    assert m.keys() == m0.keys() and max(abs(m[k].item() - m0[k].item()) for k in m0) < TOL
    assert m0["actor/pg_clipfrac"].item() > 0


def test_every_chunk_kind_is_exercised():
    """The layout above really crosses the kernel's three ways of handling a chunk."""
    p = support_problem(V=64, vocab_size=45)
    lab = p["labels"].long()
    kinds = []
    for start, vocab_start, n_valid in [(0, 0, 45), (16, 0, 45), (32, 0, 45), (0, 32, 13), (48, 32, 13)]:
        sl = slice(start, start + 16)
        plan = chunk_columns(p["offsets"], p["ids"], sl, lab[sl] - vocab_start, vocab_start, n_valid)
        kinds.append("gathered" if plan.cols is not None else "masked" if plan.membership is not None else "plain")
        dense = support_mask(p["offsets"][sl.start:sl.stop + 1] - p["offsets"][sl.start],
                             p["ids"][int(p["offsets"][sl.start]):int(p["offsets"][sl.stop])], 16, 45)
        dense = dense[:, vocab_start:vocab_start + n_valid]
        cols = torch.arange(n_valid) if plan.cols is None else plan.cols
        member = plan.member(0, plan.n_cols)
        if member is not None:  # membership per column position = the dense mask at those rows
            assert torch.equal(member, dense[:, cols])
            assert dense[:, [c for c in range(n_valid) if c not in set(cols.tolist())]].sum() == 0
    assert kinds == ["gathered", "masked", "masked", "gathered", "masked"], kinds  # the last: full tokens


def test_all_full_rows_equal_no_support():
    """Empty rows (every token sampled from the whole vocabulary) are the full path, bit for bit."""
    p = make_problem(vocab_size=83)
    T = p["labels"].shape[0]
    empty = dict(support_offsets=torch.zeros(T + 1, dtype=torch.long), support_ids=torch.zeros(0, dtype=torch.long))
    for impl in ("chunked", "naive"):
        chunks = SMALL_CHUNKS if impl == "chunked" else {}
        a = run_logprobs(p, impl, vocab_size=83, **chunks)
        b = run_logprobs(p, impl, vocab_size=83, **empty, **chunks)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), impl


def test_bad_supports_are_refused_by_name():
    p = support_problem()
    h, w, lab, off, ids = p["hidden"], p["weight"], p["labels"], p["offsets"], p["ids"]
    t = int(p["mask"].nonzero()[0])  # a token with a real label
    bad_ids = ids.clone()
    bad_ids[off[t]:off[t + 1]] = (lab[t] + 1) % 96  # the sampled token is not in its own support
    with pytest.raises(ValueError, match=rf"not in their own sampling support, e\.g\. token {t}"):
        K.linear_logprobs(h, w, lab, support_offsets=off, support_ids=bad_ids)
    with pytest.raises(ValueError, match=r"support_ids must lie in \[0, vocab_size=96\)"):
        K.linear_logprobs(h, w, lab, support_offsets=off, support_ids=torch.where(ids == ids.max(), 96, ids))
    with pytest.raises(ValueError, match=r"support_offsets must be \[T\+1\]"):
        K.linear_logprobs(h, w, lab, support_offsets=off[:-1], support_ids=ids)
    with pytest.raises(ValueError, match="support_offsets must rise"):
        K.fused_linear_loss(h, w, lab, grpo_fn(p), support_offsets=off.flip(0), support_ids=ids)
    with pytest.raises(ValueError, match="both or neither"):
        K.linear_logprobs(h, w, lab, support_offsets=off)


# --- Triton, under the interpreter ----------------------------------------------------------------

def _triton_child() -> None:
    res = {}
    for t, v in CASES:
        p = support_problem(vocab_size=v)
        kw = dict(temperature=t, vocab_size=v, **support_kw(p))
        res[f"logprobs/{t}/{v}"] = errors(run_logprobs(p, "fused", chunk_size=16, **kw), run_logprobs(p, "naive", **kw))
        p = support_problem(vocab_size=v, seed=1)
        kw = dict(temperature=t, vocab_size=v, **support_kw(p))
        (got, m), (want, m0) = run_loss(p, "fused", chunk_size=16, **kw), run_loss(p, "naive", **kw)
        res[f"loss/{t}/{v}"] = errors(got, want) + [max(abs(m[k].item() - m0[k].item()) for k in m0)
                                                    if m.keys() == m0.keys() else 1.0]
    print("RESULTS" + json.dumps(res))


@pytest.fixture(scope="module")
def triton_results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    child = "from tests.kernels.test_kernels_support import _triton_child; _triton_child()"
    proc = subprocess.run([sys.executable, "-c", child],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["logprobs", "loss"])
@pytest.mark.parametrize("temperature,vocab_size", CASES)
def test_triton_interpreted_matches_reference(triton_results, kind, temperature, vocab_size):
    e = triton_results[f"{kind}/{temperature}/{vocab_size}"]
    assert max(e) < TOL, e


# --- tensor parallel: two vocabulary shards over gloo ---------------------------------------------

TP_CASES = {"padded": (64, 45), "empty_shard": (64, 30)}


def _tp_rank(rank, world, port, impls):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported in this fresh process
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    out = {}
    try:
        for case, (v_pad, v_real) in TP_CASES.items():
            p = support_problem(V=v_pad, vocab_size=v_real)
            rows = v_pad // world
            shard = dict(p, weight=p["weight"][rank * rows:(rank + 1) * rows])
            tp = dict(tp_group=group, vocab_start=rank * rows, vocab_size=v_real, temperature=0.7, **support_kw(p))
            for impl in impls:
                chunks = SMALL_CHUNKS if impl == "chunked" else dict(chunk_size=16)
                got = run_logprobs(shard, impl, **tp, **chunks)
                loss, metrics = run_loss(shard, impl, **tp, **chunks)
                out[case, impl] = ([x.tolist() for x in got], [x.tolist() for x in loss],
                                   {k: v.item() for k, v in metrics.items()})
    finally:
        dist.destroy_process_group()
    return out


def _check_tp(results, impls):
    for case, (v_pad, v_real) in TP_CASES.items():
        p = support_problem(V=v_pad, vocab_size=v_real)
        kw = dict(vocab_size=v_real, temperature=0.7, **support_kw(p))
        want = run_logprobs(p, "naive", **kw)
        want_loss, m0 = run_loss(p, "naive", **kw)
        rows = v_pad // 2
        for impl in impls:
            for rank, res in enumerate(results):
                got, got_loss, m = (x if isinstance(x, dict) else [torch.tensor(v) for v in x] for x in res[case, impl])
                where = f"{case}/{impl}/rank{rank}"
                for g, w_ in ((got, want), (got_loss, want_loss)):
                    shard_w = w_[3][rank * rows:(rank + 1) * rows]
                    errs = errors(g[:3], w_[:3]) + [max_err(g[3], shard_w)]  # dWeight: this rank's rows
                    assert max(errs) < TOL, (where, errs)
                assert abs(got_loss[4].item() - want_loss[4].item()) < TOL, where
                assert max(abs(m[k] - m0[k].item()) for k in m0) < TOL, where


@pytest.mark.integration
def test_tp2_chunked_and_naive_match_reference():
    impls = ("chunked", "naive")
    _check_tp(run_ranks(_tp_rank, 2, impls, timeout_s=180), impls)


@pytest.mark.integration
def test_tp2_triton_interpreted_matches_reference():
    pytest.importorskip("triton")
    impls = ("fused",)
    _check_tp(run_ranks(_tp_rank, 2, impls, timeout_s=300), impls)
