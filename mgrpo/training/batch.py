"""The trainer's view of a batch: samples in, micro-batch tensors out.

The driver sends each data-parallel rank a `RankBatch` (rank_batch.py, no torch): token ids per sample plus
per-response-token fields (advantages, old / reference / rollout log-probs, aggregation weights). The rank groups the
samples into micro-batches under its token budget and turns each into a `MicroBatch` laid out as a
`BatchLayout` says:
  - padded: [b, s] right-padded rows (megatron's plain format);
  - packed (THD): the samples end to end in one row, with `PackedSeqParams` (cu_seqlens) telling the
    attention where each begins; position ids restart at 0 in every sample;
  - context parallel (cp > 1, either format): every sample (row) is padded to a multiple of 2*cp and
    this CP rank keeps chunks r and 2*cp-1-r of it (`mgrpo.models.attention.cp_positions`), with
    the global position ids of those tokens;
  - FP8: slot counts rounded up to what Transformer Engine's FP8 GEMMs take (`fp8_token_multiple`).
For the loss it keeps the flat positions of the hidden states that predict this rank's response
tokens, their labels and their per-token fields, and (algorithm.logprob_support=sampled) their
sampling supports as CSR in the same token order. Only those positions ever reach the log-prob
kernel, so padding and prompt tokens cost no vocabulary work, and a token's weight and support travel
with it whichever rank holds it.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import Optional, Sequence

import numpy as np
import torch

from mgrpo.algorithms.support import SampleSupport
from mgrpo.models.attention_layout import cp_positions
from mgrpo.training.rank_batch import TOKEN_FIELDS, RankBatch

@dataclass(frozen=True)
class BatchLayout:
    """How a rank lays out its micro-batches (the same on every rank of a model replica, except cp_rank)."""

    packed: bool = False
    """THD: samples end to end (True) or right-padded [b, s] rows (False)."""
    cp: int = 1
    cp_rank: int = 0
    seq_multiple: int = 1
    """Each sample (packed) / the row length (padded) is rounded up to a multiple of this."""
    token_multiple: int = 1
    """This rank's token count per micro-batch is rounded up to a multiple of this."""

    @property
    def global_multiple(self) -> int:
        """Slots of a whole micro-batch (all CP ranks) are a multiple of this; so is every row."""
        return math.lcm(self.seq_multiple, self.token_multiple * self.cp)

    def slots(self, length: int) -> int:
        """Slots one sample occupies before its micro-batch is known (what the packer budgets)."""
        return _round_up(length, self.seq_multiple if self.packed else self.global_multiple)


def fp8_token_multiple(recipe: str) -> int:
    """Token-count multiple of Transformer Engine's FP8 GEMMs. TE asserts (utils.assert_dim_for_fp8_exec)
    that a GEMM input's leading dims multiply to a multiple of 8 and its last dim is a multiple of 16;
    the weight-gradient GEMM contracts over tokens, so tokens need 16 (megatron's
    fp8_utils.get_fp8_align_size: 16; MXFP8 scales 32-element blocks: 32). Blockwise scaling quantises
    activations in 1x128 tiles, whose transpose for the weight gradient tiles the token dim by 128."""
    return {"mxfp8": 32, "blockwise": 128}.get(recipe, 16)


def batch_layout(*, packed: bool, cp: int = 1, cp_rank: int = 0, fp8_recipe: Optional[str] = None,
                 sp: int = 1) -> BatchLayout:
    """The layout for a parallel setup: CP needs sequences in 2*cp equal chunks; FP8 (fp8_recipe set
    when actor.fp8 is) wants 16 slots per sequence and per micro-batch (32 / 128, see fp8_token_multiple);
    sequence parallelism over `sp` TP ranks splits each rank's tokens sp ways."""
    seq = 2 * cp if cp > 1 else 1
    tokens = sp
    if fp8_recipe is not None:
        tokens = math.lcm(tokens, fp8_token_multiple(fp8_recipe))
        seq = math.lcm(seq, 16 if fp8_recipe != "mxfp8" else 32)
    return BatchLayout(packed=packed, cp=cp, cp_rank=cp_rank, seq_multiple=seq, token_multiple=tokens)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """Input ids of this rank: [b, s_local] padded rows, or [1, t_local] packed."""
    position_ids: torch.Tensor
    """Same shape: each token's position within its own sample (global position under CP)."""
    positions: torch.Tensor
    """[T] flat indices into this rank's hidden states [b * s_local] / [t_local] of the states that
    predict each of its response tokens."""
    labels: torch.Tensor
    """[T] the response tokens."""
    sample_of_token: torch.Tensor
    """[T] index of each response token's sample within the micro-batch."""
    response_lens: list[int]
    """Response length of every sample of the micro-batch (all of it, whichever rank holds it)."""
    fields: dict[str, torch.Tensor]
    """[T] per-token fields in the same order; plus 'seq_index' as [T] long, and forward_kl_topk's
    'teacher_topk_logprobs' ([T, topk] float) and 'teacher_topk_ids' ([T, topk] long)."""
    metric_weight: float = 0.0
    packed_seq_params: Optional[object] = None
    """megatron's PackedSeqParams (THD) when packed; None for padded rows."""
    token_order: Optional[torch.Tensor] = None
    """Under CP: [T] index of each of this rank's response tokens among all the micro-batch's response
    tokens in sample order (`sum(response_lens)`); None when this rank holds them all, in that order."""
    slots: int = 0
    """Token slots this micro-batch occupies on this rank (padding included)."""
    padding_mask: Optional[torch.Tensor] = None
    """Same shape as `tokens`: True at padding slots (MoE routers leave them out of the load-balancing loss)."""
    support_offsets: Optional[torch.Tensor] = None
    """[T+1] CSR offsets of the response tokens' sampling supports, in the order of `labels`; None = no
    supports (every token over the whole vocabulary). An empty row is a token sampled from all of it."""
    support_ids: Optional[torch.Tensor] = None
    """[nnz] their global vocabulary ids."""
    route_rows: Optional[torch.Tensor] = None
    """Same shape as `tokens`: each slot's row among the micro-batch's routing rows (its samples' positions
    0 .. length - 2, sample after sample), -1 for a sample's last token and padding, which have none."""
    routes: Optional[torch.Tensor] = None
    """Routing replay: [rows, layers, top_k] expert ids of those rows (RankBatch.routed_experts), else None."""

    @property
    def num_tokens(self) -> int:
        return int(self.labels.numel())

    def to(self, device) -> "MicroBatch":
        """This micro-batch on `device` (megatron's modules and TE's cu_seqlens live on the GPU)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        psp = self.packed_seq_params
        if psp is not None:
            from dataclasses import replace

            psp = replace(psp, **{k: move(getattr(psp, k)) for k in
                                  ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")})
        return MicroBatch(tokens=move(self.tokens), position_ids=move(self.position_ids), positions=move(self.positions),
                          labels=move(self.labels), sample_of_token=move(self.sample_of_token),
                          response_lens=self.response_lens, fields={k: move(v) for k, v in self.fields.items()},
                          metric_weight=self.metric_weight, packed_seq_params=psp,
                          token_order=move(self.token_order), slots=self.slots, padding_mask=move(self.padding_mask),
                          support_offsets=move(self.support_offsets), support_ids=move(self.support_ids),
                          route_rows=move(self.route_rows), routes=move(self.routes))


def build_micro_batch(batch: RankBatch, layout: BatchLayout = BatchLayout(), pad_id: int = 0) -> MicroBatch:
    """One micro-batch of this rank from the samples of `batch` (see the module doc for the layouts)."""
    from mgrpo.models.gpt import packed_seq_params

    lens, cp = batch.lengths(), layout.cp
    if any(p < 1 for p in batch.prompt_lens):
        raise ValueError("every sample needs at least one prompt token")
    if layout.packed:
        slots = [layout.slots(n) for n in lens]
        slots[-1] += _round_up(sum(slots), layout.global_multiple) - sum(slots)  # FP8: the total too
    else:
        slots = [_round_up(max(lens), layout.global_multiple)] * len(lens)
    # Vectorised over the whole micro-batch (a per-sample loop of small torch ops cost ~10x more on the
    # default job's 256 short samples): every sample laid out in its slot, then this rank's positions.
    flat = torch.tensor(list(chain.from_iterable(ids + [pad_id] * (w - len(ids))
                                                 for ids, w in zip(batch.input_ids, slots))), dtype=torch.long)
    starts = torch.tensor([0] + slots[:-1], dtype=torch.long).cumsum(0)  # each sample's offset in `flat`
    if layout.packed or cp > 1:  # positions within each sample that this rank holds (CP chunks)
        per = {w: cp_positions(w, cp, layout.cp_rank) for w in set(slots)}
        g = torch.cat([per[w] for w in slots])
        held = {w: per[w].numel() for w in per}
        sample = torch.arange(len(slots)).repeat_interleave(torch.tensor([held[w] for w in slots]))
    else:
        g = torch.arange(slots[0]).repeat(len(lens))
        sample = torch.arange(len(lens)).view(-1, 1).expand(len(lens), slots[0]).reshape(-1)
    p = torch.tensor(batch.prompt_lens, dtype=torch.long)[sample]
    n = torch.tensor(lens, dtype=torch.long)[sample]
    at = starts[sample] + g
    # the hidden state at position g predicts token g + 1: a response token when p <= g + 1 < n
    sel = torch.nonzero((g >= p - 1) & (g <= n - 2)).flatten()
    resp_lens = [m - q for m, q in zip(lens, batch.prompt_lens)]
    resp_start = torch.tensor([0] + resp_lens[:-1], dtype=torch.long).cumsum(0)
    rows_t = sample[sel]
    order_t = resp_start[rows_t] + g[sel] + 1 - p[sel]  # each selected token's index among all responses
    fields: dict[str, torch.Tensor] = {}
    for name in TOKEN_FIELDS:
        values = getattr(batch, name)
        if values is not None:
            got = list(map(len, values))
            if got != resp_lens:
                bad = next((i for i, (v, r) in enumerate(zip(got, resp_lens)) if v != r), None)
                raise ValueError(f"{name} has {got[bad]} values for a response of {resp_lens[bad]} tokens"
                                 if bad is not None else f"{name} has {len(got)} samples, the batch {len(lens)}")
            fields[name] = torch.tensor(list(chain.from_iterable(values)), dtype=torch.float32)[order_t]
    for name, dtype in (("teacher_topk_logprobs", torch.float32), ("teacher_topk_ids", torch.long)):
        rows = getattr(batch, name)
        if rows is not None:  # forward_kl_topk: [T, topk] in the labels' order
            if [len(r) for r in rows] != resp_lens:
                raise ValueError(f"{name} has {[len(r) for r in rows]} rows for responses of {resp_lens} tokens")
            fields[name] = torch.from_numpy(np.concatenate([np.asarray(r) for r in rows])).to(dtype)[order_t]
    if batch.seq_index:
        fields["seq_index"] = torch.tensor(batch.seq_index, dtype=torch.long)[rows_t]
    support = None
    if batch.support is not None:
        for s, r in zip(batch.support, resp_lens):
            if s.num_tokens != r:
                raise ValueError(f"support has {s.num_tokens} tokens for a response of {r} tokens")
        support = gather_tokens(batch.support, order_t)
    local = int(g.numel())
    shape = (1, local) if layout.packed else (len(lens), local // len(lens))
    row_start = torch.tensor([0] + [m - 1 for m in lens[:-1]], dtype=torch.long).cumsum(0)
    route_rows = torch.where(g < n - 1, row_start[sample] + g, -1)
    return MicroBatch(
        tokens=flat[at].view(shape),
        position_ids=g.view(shape),
        positions=sel,
        labels=flat[at[sel] + 1],
        sample_of_token=rows_t,
        response_lens=resp_lens,
        fields=fields,
        metric_weight=batch.metric_weight,
        packed_seq_params=packed_seq_params(lens, padded_lens=slots) if layout.packed else None,
        token_order=order_t if cp > 1 else None,
        slots=local,
        padding_mask=(g >= n).view(shape),
        support_offsets=None if support is None else support[0],
        support_ids=None if support is None else support[1],
        route_rows=route_rows.view(shape),
        routes=_routes(batch, lens),
    )


def _routes(batch: RankBatch, lens: list[int]) -> Optional[torch.Tensor]:
    """The micro-batch's routing rows [sum(length - 1), layers, top_k], sample after sample."""
    if batch.routed_experts is None:
        return None
    rows = [r if isinstance(r, torch.Tensor) else torch.tensor(r) for r in batch.routed_experts]  # Ray's are read-only
    for i, (r, n) in enumerate(zip(rows, lens)):
        if r.dim() != 3 or r.shape[0] != n - 1 or r.shape[1:] != rows[0].shape[1:]:
            raise ValueError(f"sample {batch.seq_index[i] if batch.seq_index else i}: routed experts of shape "
                             f"{tuple(r.shape)} for {n} tokens (expected [{n - 1}, layers, top_k], the same "
                             "layers and top_k for every sample)")
    return torch.cat(rows).to(torch.int64)


def _joined(parts: Sequence[array]) -> torch.Tensor:
    flat = array("i")
    for p in parts:
        flat.extend(p)
    return torch.frombuffer(flat, dtype=torch.int32).long() if len(flat) else torch.zeros(0, dtype=torch.long)


def gather_tokens(supports: Sequence[SampleSupport], order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (offsets [len(order)+1], ids [nnz], int64) of the tokens `order` picks from all the samples'
    response tokens laid end to end in sample order (a micro-batch's token order: padded, THD-packed
    or one CP rank's chunks)."""
    lens, ids = _joined([s.lens for s in supports]), _joined([s.ids for s in supports])
    starts = torch.cumsum(lens, 0) - lens
    picked = lens[order]
    offsets = torch.zeros(order.numel() + 1, dtype=torch.long)
    torch.cumsum(picked, 0, out=offsets[1:])
    # entry j of picked token i sits at starts[order[i]] + j
    within = torch.arange(int(offsets[-1])) - torch.repeat_interleave(offsets[:-1], picked)
    return offsets, ids[torch.repeat_interleave(starts[order], picked) + within]


def split_per_sample(values: torch.Tensor, response_lens: list[int]) -> list[list[float]]:
    """Inverse of the flattening: [T] -> per-sample lists. One `tolist` and list slices (256 samples of 4 tokens:
    0.09 ms, against 0.31 ms for a `torch.split` and a `tolist` per sample)."""
    flat = values.detach().float().cpu().tolist()
    if len(flat) != sum(response_lens):
        raise ValueError(f"{len(flat)} values for responses of {sum(response_lens)} tokens")
    out, start = [], 0
    for n in response_lens:
        out.append(flat[start:start + n])
        start += n
    return out


def batch_key(batch: RankBatch) -> tuple:
    """What identifies a rank's batch between the reference forward and the update: its samples and lengths."""
    return tuple(batch.seq_index), tuple(batch.lengths())


def by_sample(n: int, mbs, groups, per_mb: Sequence[dict]) -> dict:
    """Per-micro-batch per-token {'logprobs', 'entropy'} -> per-sample lists in the batch's order (the
    order its `seq_index` names; the actor client restores the experience's order from that). A value
    a forward did not compute (the reference's entropy) stays None per sample. [T, k] values (a teacher's
    'topk_logprobs' / 'topk_ids') come back as one numpy array [length, k] per sample."""
    keys = ["logprobs", "entropy"] + [k for k in ("topk_logprobs", "topk_ids") if per_mb and k in per_mb[0]]
    out: dict = {k: [None] * n for k in keys}
    for mb, idx, res in zip(mbs, groups, per_mb):
        for key, values in out.items():
            if res[key] is None:
                continue
            if res[key].dim() == 2:
                arr = res[key].detach().cpu()
                arr = arr.numpy().astype(np.float32 if arr.is_floating_point() else np.int32)
                cuts = np.cumsum(mb.response_lens)[:-1]
                for i, v in zip(idx, np.split(arr, cuts)):
                    values[i] = v
            else:
                for i, v in zip(idx, split_per_sample(res[key], mb.response_lens)):
                    values[i] = v
    return out
