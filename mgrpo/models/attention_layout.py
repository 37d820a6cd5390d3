"""Where the tokens of a sequence live under context parallelism (torch only, no megatron).

megatron and Transformer Engine split each sequence of length L (a multiple of 2*cp) into 2*cp equal
chunks and give CP rank r chunks r and 2*cp-1-r: with causal attention the early chunks are cheap and
the late ones dear, so every rank gets one of each. The batch builder (mgrpo.training.batch) and the
reference attention (mgrpo.models.attention, which builds the same split with tensor ops) follow it.
"""

from __future__ import annotations

import torch


def cp_positions(length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions (0..length-1) of one sequence that CP rank `cp_rank` holds, in its local order:
    the sequence is cut into 2*cp equal chunks, rank r holds chunk r then chunk 2*cp-1-r."""
    if cp == 1:
        return torch.arange(length)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} slots cannot be split over cp={cp} ranks "
                         f"(needs a multiple of 2*cp={2 * cp})")
    c = length // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)])
