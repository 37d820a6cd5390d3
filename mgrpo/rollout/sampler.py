"""The one CPU sampler of both CPU engines (the in-process engine, hf_engine.py, and the CPU SGLang-protocol
server, sglang/cpu/model.py; the decode loop both run is rollout/decode.py): SGLang 0.5.23's torch sampler
(srt/layers/sampler.py) with its parameters per row.

Per row, over the logits as given (a grammar's mask already applied, as SGLang's sampler sees them):
- temperature 0 or top_k=1 is greedy (argmax of the logits);
- the log-prob returned is log_softmax(logits / T) at the token (T=0: at T=1), the whole tempered distribution
  before any truncation: SGLang's output_token_logprobs, what the trainer recomputes;
- without top-k/top-p the token is drawn from softmax(logits / T) in vocabulary order (SGLang's
  `sampling_from_probs_torch`); with them from `truncate`'s weights (`top_k_top_p_min_p_sampling_from_probs_torch`:
  one descending sort, ranks >= top_k and tokens whose preceding mass already exceeds top_p zeroed). Top-p reads
  the whole distribution's mass, not the mass left after top-k, as transformers' warpers would;
- a row with a seed (SGLang's `sampling_seed`) is drawn by SGLang's seeded sampler (rollout/seeded.py: Gumbel
  noise from the seed, the position and the column), so its token depends on its own row alone; the others by
  inversion (rollout/categorical.py, the distribution torch.multinomial draws from at a tenth of its CPU cost);
- `mask_mode` ('selected' | 'support'): the sampling support and behaviour log-prob as SGLang's
  `_build_sampling_mask_output` builds them (the kept tokens by decreasing weight, log(weight / mass kept));
  `top_logprobs`: SGLang's top_logprobs_num, the highest log-probs of the same distribution (torch.topk).

Random numbers for the rows without a seed come from `generators`: one per row (the CPU server: each request
its own), or one for the whole batch (the in-process engine; torch's default generator when None), from which
every unseeded row of the batch draws one uniform per call, finished or not, as torch.multinomial over the
batch does: such a row's tokens depend on its batch (seeded rows' never do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from mgrpo.rollout.categorical import sample_categorical
from mgrpo.rollout.seeded import multinomial_with_seed


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling parameters (SGLang's per-request sampling_params)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    mask_mode: Optional[str] = None
    """'selected' | 'support': also the sampling support (SGLang's return_sampling_mask)."""
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class Draw:
    """One row's sampled token and what was asked with it."""

    token: int
    logprob: float
    mask: Optional[list[int]] = None
    """The support: kept ids by decreasing weight (with mask_mode)."""
    mask_logprob: Union[float, list[float], None] = None
    """The sampled token's behaviour log-prob over the support ('selected'), or every kept id's ('support')."""
    top: Optional[tuple[list[float], list[int]]] = None
    """(log-probs, ids), highest first (with top_logprobs)."""


Generators = Union[Sequence[Optional[torch.Generator]], torch.Generator, None]


def truncate(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights by decreasing probability, their token ids) of SGLang's torch sampler for one row `probs`
    (srt/layers/sampler.py::top_k_top_p_min_p_sampling_from_probs_torch): sort once, zero ranks >= top_k and
    tokens whose preceding mass already exceeds top_p; the support is the ids of the non-zero weights."""
    probs_sort, probs_idx = probs.sort(descending=True)
    probs_sum = probs_sort.cumsum(0)
    if top_k > 0:
        probs_sort[top_k:] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_p] = 0.0
    return probs_sort, probs_idx


def _temper(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """logits / T per row (T=0, greedy: T=1); one division when the rows share T."""
    temps = [1.0 if r.temperature == 0.0 else r.temperature for r in rows]
    if len(set(temps)) == 1:
        return logits / temps[0]
    return torch.stack([logits[i] / t for i, t in enumerate(temps)])


def sample(logits: torch.Tensor, rows: Sequence[RowSampling], positions: Sequence[int], live: Sequence[bool],
           generators: Generators = None) -> list[Optional[Draw]]:
    """One token per live row of `logits` [rows, vocab] (float32); None for the others. `positions`: per row the
    position of the last token fed (SGLang's seeded sampler hashes it with the seed); `generators`: see above."""
    per_row = isinstance(generators, (list, tuple))
    scaled = _temper(logits, rows)
    logp = torch.log_softmax(scaled, dim=-1)
    n = len(rows)
    # rows that draw: the live sampled ones, and with one generator for the batch every unseeded one
    draws = [i for i, r in enumerate(rows) if not r.greedy and (live[i] or (not per_row and r.seed is None))]
    probs = torch.softmax(scaled, dim=-1) if draws else None
    tokens: list[Optional[int]] = [None] * n
    sort: dict[int, tuple[torch.Tensor, torch.Tensor, Optional[int]]] = {}  # row -> (weights, ids, picked column)
    for i in draws:
        if rows[i].truncated:
            sort[i] = (*truncate(probs[i], rows[i].top_k, rows[i].top_p), None)
    for i, r in enumerate(rows):
        if live[i] and r.greedy:
            tokens[i] = int(torch.argmax(logits[i]))
    seeded = [i for i in draws if rows[i].seed is not None]
    whole = [i for i in seeded if not rows[i].truncated]
    if whole:  # the whole vocabulary, log(probs) in vocabulary order, all such rows at once
        picks = multinomial_with_seed(torch.log(probs[whole]), torch.tensor([rows[i].seed for i in whole]),
                                      torch.tensor([positions[i] for i in whole])).view(-1).tolist()
        for i, t in zip(whole, picks):
            tokens[i] = t
    for i in seeded:
        if rows[i].truncated:  # Gumbel over the sorted columns, in float64
            w, ids, _ = sort[i]
            pick = int(multinomial_with_seed(w.to(torch.float64).log().view(1, -1), torch.tensor([rows[i].seed]),
                                             torch.tensor([positions[i]])))
            sort[i] = (w, ids, pick)
            tokens[i] = int(ids[pick])
    unseeded = [i for i in draws if rows[i].seed is None]
    groups = [[i] for i in unseeded] if per_row else [[i for i in unseeded if not rows[i].truncated],
                                                        [i for i in unseeded if rows[i].truncated]]
    for group in groups:
        if not group:
            continue
        weights = torch.stack([sort[i][0] for i in group]) if rows[group[0]].truncated else probs[group]
        gen = generators[group[0]] if per_row else generators
        for i, col in zip(group, sample_categorical(weights, generator=gen).view(-1).tolist()):
            if rows[i].truncated:
                sort[i] = (sort[i][0], sort[i][1], col)
                tokens[i] = int(sort[i][1][col])
            else:
                tokens[i] = col
    out: list[Optional[Draw]] = [None] * n
    for i, r in enumerate(rows):
        if not live[i]:
            continue
        tok = tokens[i]
        d = out[i] = Draw(tok, float(logp[i, tok]))
        if r.top_logprobs:
            vals, idx = torch.topk(logp[i], min(r.top_logprobs, logp.shape[-1]))
            d.top = (vals.tolist(), idx.tolist())
        if r.mask_mode is not None:
            _mask(d, r.mask_mode, None if r.greedy else sort.get(i) or _sorted(probs[i], tok))
    return out


def _sorted(probs: torch.Tensor, tok: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """An untruncated row's weights by decreasing probability, for its support."""
    probs_sort, probs_idx = probs.sort(descending=True)
    return probs_sort, probs_idx, int((probs_idx == tok).nonzero()[0])


def _mask(d: Draw, mode: str, sort: Optional[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """sampler.py::_build_sampling_mask_output for the torch sampler (greedy: _build_greedy_sampling_mask_output):
    the kept tokens (weights > 0) by decreasing weight; the behaviour log-prob log(weight / mass kept) of the
    sampled one, or of each."""
    if sort is None:
        d.mask, d.mask_logprob = [d.token], ([0.0] if mode == "support" else 0.0)
        return
    probs_sort, probs_idx, pick = sort
    kept = int((probs_sort > 0).sum())  # sorted descending: the kept tokens lead
    mass = probs_sort[:kept].sum(dtype=torch.float32)
    d.mask = probs_idx[:kept].tolist()
    if mode == "support":
        d.mask_logprob = torch.log(probs_sort[:kept].float() / mass).tolist()
    else:
        d.mask_logprob = float(torch.log(probs_sort[pick].float() / mass))
