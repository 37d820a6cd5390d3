"""What the driver sends a data-parallel rank: `RankBatch` (plain lists and numpy, so it pickles small and the
driver never needs torch), and the compact routing arrays it may carry. The rank turns it into
micro-batch tensors (`mgrpo/training/batch.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from mgrpo.algorithms.support import SampleSupport

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
    support: Optional[list[SampleSupport]] = None
    """Each sample's per-response-token sampling supports (algorithm.logprob_support=sampled), or None:
    every token normalised over the whole vocabulary."""
    teacher_topk_logprobs: Optional[list] = None
    teacher_topk_ids: Optional[list] = None
    """algorithm.opd.loss_mode=forward_kl_topk: per sample [response length, topk] arrays, the teacher's top
    log-probs at each response position and their ids (`Experience.teacher_topk_*`)."""
    routed_experts: Optional[list] = None
    """Routing replay: per sample the experts to send each position to, [length - 1, layers, top_k] integer
    arrays (numpy or torch; the last token's row and padding get `default_route`)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def select(self, idx: list[int]) -> "RankBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return RankBatch(
            input_ids=pick(self.input_ids), prompt_lens=pick(self.prompt_lens),
            seq_index=pick(self.seq_index) if self.seq_index else [],
            **{f: pick(getattr(self, f)) for f in TOKEN_FIELDS}, metric_weight=self.metric_weight,
            support=pick(self.support), routed_experts=pick(self.routed_experts),
            teacher_topk_logprobs=pick(self.teacher_topk_logprobs), teacher_topk_ids=pick(self.teacher_topk_ids))


def compact_routes(routes: np.ndarray) -> np.ndarray:
    """Expert ids in the smallest integer type that holds them: one byte per id below 256 experts (a
    Qwen3-30B-A3B token is 48 layers x 8 ids = 384 bytes), two below 32768."""
    top = int(routes.max(initial=0))
    if routes.size and int(routes.min()) < 0:
        raise ValueError(f"routed experts hold a negative expert id ({int(routes.min())})")
    return routes.astype(np.uint8 if top < 256 else np.int16 if top < 32768 else np.int32, copy=False)
