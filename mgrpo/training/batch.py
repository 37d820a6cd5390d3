"""The trainer's view of a batch: samples in, padded micro-batch tensors out.

The driver sends each data-parallel rank a `RankBatch`: token ids per sample plus per-response-token
fields (advantages, old / reference / rollout log-probs, aggregation weights). The rank packs the
samples into micro-batches under its token budget and turns each into a `MicroBatch`: right-padded
token ids for Megatron and, for the loss, the flat positions of the response tokens. Only those
positions ever reach the log-prob kernel, so padding and prompt tokens cost no vocabulary work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Per-response-token fields a RankBatch may carry (each a list of per-sample lists of floats).
TOKEN_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "token_weight")


@dataclass
class RankBatch:
    input_ids: list[list[int]]
    """Prompt + response token ids per sample."""
    prompt_lens: list[int]
    seq_index: list[int] = field(default_factory=list)
    """Index of each sample in the global mini-batch (sequence-level losses such as GSPO)."""
    advantages: Optional[list[list[float]]] = None
    old_logprobs: Optional[list[list[float]]] = None
    ref_logprobs: Optional[list[list[float]]] = None
    rollout_logprobs: Optional[list[list[float]]] = None
    token_weight: Optional[list[list[float]]] = None
    """Loss-aggregation weight of each response token, normalised over the global mini-batch."""
    metric_weight: float = 0.0
    """1 / (response tokens in the global mini-batch): turns token sums into global token means."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def select(self, idx: list[int]) -> "RankBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return RankBatch(
            input_ids=pick(self.input_ids), prompt_lens=pick(self.prompt_lens),
            seq_index=pick(self.seq_index) if self.seq_index else [],
            **{f: pick(getattr(self, f)) for f in TOKEN_FIELDS}, metric_weight=self.metric_weight)


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """[b, s] right-padded input ids."""
    position_ids: torch.Tensor
    positions: torch.Tensor
    """[T] flat indices (row * s + t - 1) of the hidden states that predict each response token t."""
    labels: torch.Tensor
    """[T] the response tokens."""
    sample_of_token: torch.Tensor
    """[T] row of each response token within the micro-batch."""
    response_lens: list[int]
    fields: dict[str, torch.Tensor]
    """[T] per-token fields flattened in the same order; plus 'seq_index' as [T] long."""
    metric_weight: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.labels.numel())


def build_micro_batch(batch: RankBatch, pad_id: int = 0) -> MicroBatch:
    b = len(batch)
    s = max(batch.lengths())
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    positions, labels, rows, resp_lens = [], [], [], []
    for row, (ids, p) in enumerate(zip(batch.input_ids, batch.prompt_lens)):
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        r = len(ids) - p
        if p < 1:
            raise ValueError("every sample needs at least one prompt token")
        positions.extend(row * s + t - 1 for t in range(p, len(ids)))
        labels.extend(ids[p:])
        rows.extend([row] * r)
        resp_lens.append(r)
    fields: dict[str, torch.Tensor] = {}
    for name in TOKEN_FIELDS:
        values = getattr(batch, name)
        if values is not None:
            for v, r in zip(values, resp_lens):
                if len(v) != r:
                    raise ValueError(f"{name} has {len(v)} values for a response of {r} tokens")
            fields[name] = torch.tensor([x for v in values for x in v], dtype=torch.float32)
    if batch.seq_index:
        fields["seq_index"] = torch.tensor([batch.seq_index[i] for i in rows], dtype=torch.long)
    return MicroBatch(
        tokens=tokens,
        position_ids=torch.arange(s).unsqueeze(0).expand(b, s),
        positions=torch.tensor(positions, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        sample_of_token=torch.tensor(rows, dtype=torch.long),
        response_lens=resp_lens,
        fields=fields,
        metric_weight=batch.metric_weight,
    )


def split_per_sample(values: torch.Tensor, response_lens: list[int]) -> list[list[float]]:
    """Inverse of the flattening: [T] -> per-sample lists."""
    return [chunk.tolist() for chunk in torch.split(values.detach().float().cpu(), response_lens)]
