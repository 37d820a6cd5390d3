"""Gradient invariance of every aggregation mode to how the global batch is cut.

The same global mini-batch is processed as 1, 2 or 4 micro-batches (and, for the token-level loss,
in chunks of tokens as the fused kernel does), and split over DP=2 gloo ranks whose gradients are
all-reduced with SUM. With weights normalised over the global batch (aggregation.token_weights) all
of these must give the same gradient; a per-micro-batch normalisation would not (checked too, so the
test can tell the difference).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mgrpo.algorithms.aggregation import global_counts, metric_weights, token_weights
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn, policy_loss
from mgrpo.algorithms.registry import AGGREGATION_MODES
from mgrpo.config import AlgorithmConfig
from tests.helpers.distributed import run_ranks

V, H, N, L = 11, 8, 8, 6
LENGTHS = [6, 3, 1, 5, 0, 2, 6, 4]  # row 4 fully masked (e.g. overlong-filtered): must not count
VANILLA = AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tis_cap=2.0,
                          use_kl_loss=True, kl_loss_type="low_var_kl", kl_coef=0.1, entropy_coeff=0.01)
GSPO = replace(VANILLA, policy_loss="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05)


class TinyLM(torch.nn.Module):
    """Per-token log-probs and entropies of label tokens; stands in for the policy model."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.out = torch.nn.Linear(H, V)

    def forward(self, tokens, labels):
        logp = torch.log_softmax(self.out(torch.tanh(self.emb(tokens))), -1)
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def make_problem():
    """Model and global batch, identical in every process (fixed seeds, float64)."""
    torch.manual_seed(0)
    model = TinyLM().double()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (N, L), generator=g)
    labels = torch.randint(0, V, (N, L), generator=g)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(L)] for n in LENGTHS], dtype=torch.float64)
    with torch.no_grad():
        lp0, _ = model(tokens, labels)
    noise = lambda s: s * torch.randn(N, L, generator=g, dtype=torch.float64)  # noqa: E731
    old = lp0 + noise(0.3)  # off-policy enough that some tokens clip
    data = dict(tokens=tokens, labels=labels, mask=mask, old=old, ref=lp0 + noise(0.2), roll=old + noise(0.3),
                adv=torch.randn(N, 1, generator=g, dtype=torch.float64).expand(N, L) * mask)
    return model, data


def grad_of_rows(model, data, rows, mode, cfg, *, chunk=None, counts=None):
    """(gradients, metrics) of the loss over `rows` with weights normalised by `counts`
    (the global counts unless a test passes local ones)."""
    tok, seq = counts if counts is not None else global_counts(data["mask"].numpy())
    d = {k: v[rows] for k, v in data.items()}
    # the driver's weights (numpy), as the rank gets them (tensors)
    w = torch.from_numpy(token_weights(d["mask"].numpy(), mode, global_tokens=tok, global_seqs=seq,
                                       max_response_length=L))
    inputs = TokenLossInputs(
        old_logprob=d["old"].flatten(), advantages=d["adv"].flatten(), token_weight=w.double().flatten(),
        metric_weight=torch.from_numpy(metric_weights(d["mask"].numpy(), global_tokens=tok)).double().flatten(),
        ref_logprob=d["ref"].flatten(), rollout_logprob=d["roll"].flatten(),
        seq_index=torch.as_tensor(rows).unsqueeze(-1).expand(-1, L).flatten())
    model.zero_grad()
    lp, ent = model(d["tokens"], d["labels"])
    lp, ent = lp.flatten(), ent.flatten()
    if cfg.policy_loss == "gspo":
        loss, metrics = policy_loss(lp, ent, inputs, cfg)
    else:
        fn, loss, metrics = make_token_loss_fn(inputs, cfg), 0.0, {}
        step = chunk or lp.shape[0]
        for s in range(0, lp.shape[0], step):  # chunk by chunk, as the fused kernel calls it
            sl = slice(s, s + step)
            lc, mc = fn(lp[sl], ent[sl], sl)
            loss = loss + lc
            metrics = {k: metrics.get(k, 0.0) + v for k, v in mc.items()}
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], {k: float(v) for k, v in metrics.items()}


def accumulate(model, data, splits, mode, cfg, chunk=None):
    grads, metrics = None, {}
    for rows in splits:
        g, m = grad_of_rows(model, data, rows, mode, cfg, chunk=chunk)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        metrics = {k: metrics.get(k, 0.0) + v for k, v in m.items()}
    return grads, metrics


SPLITS = {
    1: [list(range(8))],
    2: [list(range(4)), list(range(4, 8))],
    4: [[0, 1], [2, 3], [4, 5], [6, 7]],
    "uneven": [[5], [0, 1, 2], [3, 4, 6, 7]],
}


def _close(a, b, tol=1e-6):
    return all(torch.allclose(x, y, atol=tol, rtol=0) for x, y in zip(a, b))


@pytest.mark.parametrize("cfg", [VANILLA, GSPO], ids=["vanilla", "gspo"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_invariant_to_micro_batching(mode, cfg):
    model, data = make_problem()
    ref_grads, ref_metrics = accumulate(model, data, SPLITS[1], mode, cfg)
    assert any(g.abs().max() > 1e-3 for g in ref_grads)  # a real gradient, not trivially zero
    for name, splits in SPLITS.items():
        for chunk in (None, 5) if cfg.policy_loss == "vanilla" else (None,):
            grads, metrics = accumulate(model, data, splits, mode, cfg, chunk=chunk)
            assert _close(grads, ref_grads), (name, chunk)
            assert metrics.keys() == ref_metrics.keys()
            for k in metrics:
                assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-9), (name, chunk, k)
    # Normalising each micro-batch by its own counts is not invariant: this is what the test catches.
    local = None
    for rows in SPLITS[2]:
        g, _ = grad_of_rows(model, data, rows, mode, cfg, counts=global_counts(data["mask"][rows].numpy()))
        local = g if local is None else [a + b for a, b in zip(local, g)]
    assert not _close(local, ref_grads)


DP_CASES = [(mode, VANILLA) for mode in AGGREGATION_MODES] + [("seq-mean-token-mean", GSPO)]


def _dp_rank(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    try:
        for mode, cfg in DP_CASES:
            model, data = make_problem()
            # this rank's half of the global batch, itself cut into 2 micro-batches
            mine = [list(range(rank * 4, rank * 4 + 2)), list(range(rank * 4 + 2, rank * 4 + 4))]
            grads, metrics = accumulate(model, data, mine, mode, cfg,
                                        chunk=5 if cfg.policy_loss == "vanilla" else None)
            for gr in grads:
                dist.all_reduce(gr, op=dist.ReduceOp.SUM)  # SUM: the 1/N is already in the token weights
            m = torch.tensor([metrics[k] for k in sorted(metrics)], dtype=torch.float64)
            dist.all_reduce(m, op=dist.ReduceOp.SUM)
            # plain lists: torch tensors would travel as shared-memory handles that die with this process
            out.append(([gr.tolist() for gr in grads], dict(zip(sorted(metrics), m.tolist()))))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_gradient_invariant_across_data_parallel_ranks():
    results = run_ranks(_dp_rank, 2)
    for i, (mode, cfg) in enumerate(DP_CASES):
        model, data = make_problem()
        ref_grads, ref_metrics = accumulate(model, data, SPLITS[1], mode, cfg)
        for per_rank in results:
            grads, metrics = per_rank[i]
            grads = [torch.tensor(gr, dtype=torch.float64) for gr in grads]
            assert _close(grads, ref_grads), (mode, cfg.policy_loss)
            assert metrics.keys() == ref_metrics.keys()
            for k, v in ref_metrics.items():
                assert metrics[k] == pytest.approx(v, abs=1e-9), (mode, k)
