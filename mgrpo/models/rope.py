"""RoPE for THD-packed sequences without a Python loop over the sequences.

megatron-core's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`, the path taken whenever
`config.apply_rope_fusion` is off: on CPU, and on a GPU without Transformer Engine) builds each
token's rotary frequencies one sequence at a time (`_get_thd_freqs_on_this_cp_rank` per sequence, a
`.item()` per sequence in the offset case, then `torch.cat`), for q and for k in every layer. On the
default job's 256 short sequences that loop is ~6 ms of a ~28 ms forward on CPU, and on a GPU each
`.item()` is a host sync. The rotation itself is one elementwise call on the whole packed tensor.

`apply_rotary_pos_emb_thd` below computes every token's row of `freqs` with tensor ops, gathers
`freqs` once and calls megatron's own `_apply_rotary_pos_emb_bshd` once, on the same tensors megatron
builds: the result is bitwise megatron's (tests/models/test_rope_thd.py compares them with torch.equal).
It follows megatron's two cases:
  - `freqs` covers max-seqlen positions: every sequence reads rows from 0 (the usual case);
  - `freqs.size(0) == cu_seqlens[-1]` (freqs for every packed position, e.g. multimodal RoPE):
    sequence i reads rows from its offset cu_seqlens[i];
and context parallelism: a sequence of global length L holds L/cp tokens on each rank, the first
half from chunk r and the second from chunk 2cp-1-r of its 2cp chunks (megatron's zig-zag split).

`install()` puts it where megatron's `apply_rotary_pos_emb` looks the function up. It is a speed
patch of megatron's unfused baseline (TE's fused THD kernel, used with `apply_rope_fusion`, is not
touched), exact on any device, so it is installed on CPU and GPU alike (`mgrpo.training.parallel`).
Its `premise` says whether the installed megatron-core still has the code it replaces; where it does
not, megatron's own function stays (correct, only slower) and tests/models/test_rope_thd.py fails by name.
"""

from __future__ import annotations

import importlib
import inspect

import torch

_ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
_megatron_thd = None  # megatron's function, kept when install() replaces it (the tests' reference)


def thd_freq_rows(cu_seqlens: torch.Tensor, freqs_len: int, n_tokens: int, cp_size: int,
                  cp_rank: int) -> torch.Tensor:
    """For each of this rank's `n_tokens` packed tokens, the row of `freqs` (of `freqs_len` rows)
    that megatron's per-sequence loop gives it. One host sync, for the checks and the case."""
    cu = cu_seqlens.to(torch.long)
    local = (cu[1:] - cu[:-1]) // cp_size  # tokens of each sequence on this rank (megatron's seqlens)
    seg = local // 2  # with CP: the length of each of a sequence's two chunks on this rank
    # the last row of freqs each sequence reads, counting from its first (-1 when it is empty):
    #   cp == 1: local - 1;   cp > 1: the second chunk ends at cp*local - cp_rank*seg - 1
    last = local - 1 if cp_size == 1 else torch.where(local > 0, cp_size * local - cp_rank * seg - 1, -1)
    none = cu.new_full((1,), -1)
    total, tokens, odd, last_row, last_row_offset = torch.stack([
        cu[-1], local.sum(), (local % 2).sum() if cp_size > 1 else cu.new_zeros(()),
        torch.cat([none, last]).max(), torch.cat([none, torch.where(local > 0, cu[:-1] + last, -1)]).max(),
    ]).tolist()
    if tokens != n_tokens:
        raise ValueError(f"THD RoPE: cu_seqlens {cu_seqlens.tolist()} over cp={cp_size} give {tokens} tokens on "
                         f"this rank, but the packed tensor has {n_tokens}")
    if odd:
        raise ValueError(f"THD RoPE: with cp={cp_size} every sequence's length must be a multiple of 2*cp; "
                         f"cu_seqlens {cu_seqlens.tolist()}")
    offsets = freqs_len == total  # megatron's case 1: freqs for every packed position
    if (last_row_offset if offsets else last_row) >= freqs_len:
        raise ValueError(f"THD RoPE: freqs has {freqs_len} rows, the sequences of cu_seqlens "
                         f"{cu_seqlens.tolist()} need {(last_row_offset if offsets else last_row) + 1}")
    device = cu.device
    seq = torch.repeat_interleave(torch.arange(local.numel(), device=device), local, output_size=n_tokens)
    pos = torch.arange(n_tokens, device=device) - (torch.cumsum(local, 0) - local)[seq]  # index within the sequence
    if cp_size == 1:
        rows = pos
    else:
        s = seg[seq]
        rows = torch.where(pos < s, cp_rank * s + pos, cp_size * local[seq] - (cp_rank + 2) * s + pos)
    return rows + cu[:-1][seq] if offsets else rows


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *bshd_args,
                             cp_group=None, **bshd_kwargs) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_thd`, vectorised. t: [tokens, heads, dim]; cu_seqlens: the
    global (all CP ranks) cumulative lengths; freqs: [rows, 1, 1, rot_dim]. Every other argument
    (rotary_interleaved, multi_latent_attention or its newer name, mscale) goes to megatron's
    `_apply_rotary_pos_emb_bshd` unchanged."""
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    rope_utils = importlib.import_module(_ROPE_UTILS)
    rows = thd_freq_rows(cu_seqlens, freqs.size(0), t.size(0), cp_group.size(), cp_group.rank())
    packed = freqs.index_select(0, rows.to(freqs.device))
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, *bshd_args, **bshd_kwargs).squeeze(1)


def premise() -> bool:
    """True while megatron-core's unfused THD RoPE is the per-sequence loop this module reproduces:
    the zig-zag CP slices, the two freqs cases, and `apply_rotary_pos_emb` calling it by module name."""
    rope_utils = importlib.import_module(_ROPE_UTILS)
    needed = ("_get_thd_freqs_on_this_cp_rank", "_apply_rotary_pos_emb_bshd", "apply_rotary_pos_emb")
    if not all(hasattr(rope_utils, name) for name in needed):
        return False
    slices = inspect.getsource(rope_utils._get_thd_freqs_on_this_cp_rank)
    thd = inspect.getsource(megatron_thd())
    return all(needle in slices for needle in (
        "full_seqlen = cp_size * x.size(0)",
        "freqs[offset + cp_rank * cp_seg : offset + (cp_rank + 1) * cp_seg]",  # chunk r
        "- (cp_rank + 1) * cp_seg : offset",  # chunk 2cp-1-r
        "return freqs[offset : offset + x.size(0)]",  # cp == 1
    )) and ("_get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs" in thd and "cu_seqlens[-1]" in thd
            and "return _apply_rotary_pos_emb_thd(" in inspect.getsource(rope_utils.apply_rotary_pos_emb))


def megatron_thd():
    """megatron's own `_apply_rotary_pos_emb_thd` (also after install())."""
    return _megatron_thd or importlib.import_module(_ROPE_UTILS)._apply_rotary_pos_emb_thd


def install() -> bool:
    """Replace megatron's unfused THD RoPE with `apply_rotary_pos_emb_thd` (idempotent) where the
    premise holds; return whether it is installed."""
    global _megatron_thd
    rope_utils = importlib.import_module(_ROPE_UTILS)
    if rope_utils._apply_rotary_pos_emb_thd is apply_rotary_pos_emb_thd:
        return True
    if not premise():
        return False
    _megatron_thd = rope_utils._apply_rotary_pos_emb_thd
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
    return True
