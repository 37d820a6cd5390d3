"""Sampling supports of response tokens (algorithm.logprob_support=sampled), kept compactly.

With rollout.top_k / rollout.top_p the engine samples each token from the tempered distribution
truncated to a support (SGLang: the top-k tokens whose preceding mass in the whole distribution is
at most top_p; transformers: top-p of the renormalised top-k) and renormalised over it. With
logprob_support=sampled the trainer's old, reference and current log-probs, and the entropy, are
renormalised over the same supports (mgrpo_kernels does the arithmetic), so the importance ratio is the
ratio of the policies that actually sampled; with `full` (the default) they are those of the whole
tempered distribution.

A response's supports are held as CSR in two int32 arrays (`SampleSupport`): the number of ids of
each token (0 = the whole vocabulary: nothing was cut) and the ids themselves, ascending per token.
Never a vocabulary-wide mask: top_k = 50 costs 200 bytes per token. They are `array.array('i')`, not
tensors: a step's few hundred responses travel to the trainer ranks (twice) and a torch tensor costs
~0.3 ms to pickle however small, 100x an array's (measured: 256 responses, 152 ms vs 1.1 ms). No torch here: the
torch-free driver builds them; the rank lays them out per micro-batch (`training/batch.py::gather_tokens`).
"""

from __future__ import annotations

from array import array
from typing import NamedTuple, Optional, Sequence


class SampleSupport(NamedTuple):
    """One response's per-token sampling supports, CSR."""

    lens: array
    """int32 [response length]: ids in each token's support; 0 = sampled from the whole vocabulary."""
    ids: array
    """int32 [sum(lens)]: the ids, token after token, ascending within a token."""

    @classmethod
    def from_tokens(cls, rows: Sequence[Optional[Sequence[int]]]) -> "SampleSupport":
        """From an engine's per-token lists (`GenerateResult.support`: None = the whole vocabulary)."""
        if any(r is not None and len(r) == 0 for r in rows):
            raise ValueError("an empty sampling support (a token must be in its own support; None means the "
                             "whole vocabulary)")
        return cls(array("i", [0 if r is None else len(r) for r in rows]),
                   array("i", [i for r in rows if r is not None for i in r]))

    @property
    def num_tokens(self) -> int:
        return len(self.lens)

    def to_json(self) -> list:
        return [self.lens.tolist(), self.ids.tolist()]

    @classmethod
    def from_json(cls, data: list) -> "SampleSupport":
        return cls(array("i", data[0]), array("i", data[1]))
