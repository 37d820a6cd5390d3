"""The data, rewards and algorithms rooms compose into GRPO that learns (no Megatron, no Ray).

A tiny GRU language model samples answers to the synthetic sum prompts; the Rules scores them, GRPO
advantages and the token loss (through make_token_loss_fn, as the fused kernel calls it) update it.
Mean reward must rise well above the random-policy level (~0.005) within 80 steps: a sign error, a
broken advantage, a wrong reward or misaligned log-probs all keep it near zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgrpo.algorithms.advantages import compute_advantages
from mgrpo.algorithms.aggregation import global_counts, metric_weights, token_weights
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn
from mgrpo.config import MGRPOConfig
from mgrpo.data import PromptDataset, synthetic_tokenizer
from mgrpo.rewards import Rules, ScoreRequest


class GRU(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb, self.rnn, self.out = torch.nn.Embedding(vocab, 64), torch.nn.GRU(64, 128, batch_first=True), \
            torch.nn.Linear(128, vocab)

    def forward(self, x):
        return torch.log_softmax(self.out(self.rnn(self.emb(x))[0]), -1)


def sample(model, prompts, max_len, eos, pad):
    """Sampled responses [N, max_len] (pad after EOS) and their lengths (EOS included)."""
    seq, done, lens = prompts, torch.zeros(len(prompts), dtype=torch.bool), torch.zeros(len(prompts), dtype=torch.long)
    for _ in range(max_len):
        nxt = torch.multinomial(model(seq)[:, -1].exp(), 1).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        lens += (~done).long()
        seq = torch.cat([seq, nxt[:, None]], 1)
        done |= nxt == eos
    return seq[:, prompts.shape[1]:], lens


@pytest.mark.system
def test_grpo_learns_the_sum_task():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threading only adds overhead (and the run stays deterministic)
    try:
        _learn()
    finally:
        torch.set_num_threads(threads)


def _learn():
    torch.manual_seed(0)
    cfg = MGRPOConfig()
    cfg.reward.num_workers = 0
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.entropy_coeff = 0.0  # this loop computes no entropy (the loss gets None)
    tok, n, max_len = synthetic_tokenizer(), cfg.rollout.n, cfg.data.max_response_length
    data, judger = PromptDataset(cfg.data, tok), Rules(cfg.reward)
    model = GRU(cfg.model.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    history = []
    for _ in range(80):
        items = data.next_batch()
        prompts = torch.tensor([it.prompt_ids for it in items]).repeat_interleave(n, 0)
        with torch.no_grad():
            resp, lens = sample(model, prompts, max_len, tok.eos_token_id, tok.pad_token_id)
        mask = (torch.arange(max_len)[None] < lens[:, None]).float()
        texts = tok.batch_decode([r[:k].tolist() for r, k in zip(resp, lens)], skip_special_tokens=True)
        stopped = [bool((r[:k] == tok.eos_token_id).any()) for r, k in zip(resp, lens)]
        scores = torch.tensor(judger.score([
            ScoreRequest(items[i // n].data_source, texts[i], items[i // n].ground_truth,
                         {"finish_reason": "stop" if stopped[i] else "length"}) for i in range(len(texts))
        ]).scores)
        # the driver's bookkeeping (numpy), handed to the loss as tensors as the rank gets them
        adv = torch.from_numpy(compute_advantages(scores.numpy(), np.repeat(np.arange(len(items)), n), mask.numpy(),
                                                  cfg.algorithm))

        full = torch.cat([prompts, resp], 1)

        def logprobs():  # position p predicts token p + 1: response tokens from the prompt's last position
            lp = model(full[:, :-1])[:, prompts.shape[1] - 1:]
            return lp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)

        with torch.no_grad():
            old = logprobs()
        tokens, seqs = global_counts(mask.numpy())
        w = torch.from_numpy(token_weights(mask.numpy(), cfg.algorithm.loss_agg_mode, global_tokens=tokens,
                                           global_seqs=seqs, max_response_length=max_len))
        inputs = TokenLossInputs(old.flatten(), adv.flatten(), w.flatten(),
                                 torch.from_numpy(metric_weights(mask.numpy(), global_tokens=tokens)).flatten())
        loss, _ = make_token_loss_fn(inputs, cfg.algorithm)(logprobs().flatten(), None, slice(0, w.numel()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(scores.mean().item())
    judger.close()
    assert sum(history[:5]) / 5 < 0.05
    assert sum(history[-10:]) / 10 > 0.12, history
