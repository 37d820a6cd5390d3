"""The vectorised THD RoPE (mgrpo/models/rope.py) against megatron-core's own per-sequence loop:
bitwise equal (torch.equal) output and input gradient for both freqs layouts, CP 1/2/4 on every rank,
interleaved and half-split rotation, partial rotary dims and mscale; installed where megatron's
`apply_rotary_pos_emb` dispatches its unfused THD path; clear errors for inconsistent inputs."""

from __future__ import annotations

import itertools

import pytest
import torch

from mgrpo.models import rope


class _CpGroup:
    """The CP group as the RoPE functions read it: megatron's and ours call only size() and rank()
    (the multi-rank runs in tests/training/test_context_parallel.py use real gloo groups)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_premise_still_holds():
    assert rope.premise(), ("mgrpo.models.rope no longer matches megatron-core's _apply_rotary_pos_emb_thd / "
                            "_get_thd_freqs_on_this_cp_rank / apply_rotary_pos_emb; re-check mgrpo/models/rope.py")


def _inputs(cp: int, seed: int, rot_dim: int, dim: int = 16, heads: int = 3, empty: bool = True):
    g = torch.Generator().manual_seed(seed)
    # global lengths, multiples of 2*cp, lengths repeated and not, and (`empty`) an empty sequence
    lens = [2 * cp * int(n) for n in torch.randint(1, 6, (9,), generator=g)] + [0] * empty + [2 * cp, 2 * cp * 7]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t = torch.randn(sum(lens) // cp, heads, dim, generator=g)
    w = torch.randn(t.shape, generator=g)
    return cu, t, w, g


def _run(fn, t, w, **kw):
    x = t.clone().requires_grad_(True)
    out = fn(x, **kw)
    (out * w).sum().backward()
    return out.detach(), x.grad


CASES = list(itertools.product([1, 2, 4], ["max_seqlen", "all_positions"], [False, True]))


@pytest.mark.parametrize("cp, layout, interleaved", CASES, ids=[f"cp{c}-{lay}-{'inter' if i else 'half'}"
                                                                  for c, lay, i in CASES])
def test_bitwise_equal_to_megatron(cp, layout, interleaved):
    megatron = rope.megatron_thd()
    assert megatron is not rope.apply_rotary_pos_emb_thd
    for seed, rot_dim in [(0, 16), (1, 8)]:  # rot_dim < dim: megatron passes the rest through unrotated
        # (megatron-core 0.19.2 applies the interleaved rotation per sequence and fails on an empty one)
        cu, t, w, g = _inputs(cp, seed, rot_dim, empty=not interleaved)
        rows = int(cu[-1]) if layout == "all_positions" else int(torch.diff(cu).max()) + 5
        freqs = torch.randn(rows, 1, 1, rot_dim, generator=g) * 10
        for rank in range(cp):
            kw = dict(cu_seqlens=cu, freqs=freqs, rotary_interleaved=interleaved, mscale=1.0 + 0.5 * seed,
                      cp_group=_CpGroup(cp, rank))
            ref_out, ref_grad = _run(megatron, t, w, **kw)
            out, grad = _run(rope.apply_rotary_pos_emb_thd, t, w, **kw)
            assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad), (seed, rank)
            assert not torch.equal(out[:, :, :rot_dim], t[:, :, :rot_dim])  # it did rotate


def test_rows_follow_the_zigzag_split():
    """Independent of megatron: rank r of cp=2 holds chunks r and 3-r of each sequence's 4 chunks."""
    cu = torch.tensor([0, 8, 12])
    assert rope.thd_freq_rows(cu, 8, 6, 2, 0).tolist() == [0, 1, 6, 7, 0, 3]
    assert rope.thd_freq_rows(cu, 8, 6, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]
    # freqs for all 12 packed positions: each sequence reads from its offset cu[i]
    assert rope.thd_freq_rows(cu, 12, 6, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert rope.thd_freq_rows(cu, 12, 12, 1, 0).tolist() == list(range(12))


def test_installed_where_megatron_dispatches():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert rope.install() and rope.install()  # idempotent
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rotary_pos_emb_thd
    config = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=3, apply_rope_fusion=False,
                               use_cpu_initialization=True)
    cu, t, _, g = _inputs(2, 3, 16)
    freqs = torch.randn(int(torch.diff(cu).max()), 1, 1, 16, generator=g)
    group = _CpGroup(2, 1)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
    assert torch.equal(out, rope.megatron_thd()(t, cu, freqs, cp_group=group))


@pytest.mark.parametrize("cu, tokens, cp, rows, match", [
    ([0, 8, 12], 5, 2, 8, "give 6 tokens on this rank, but the packed tensor has 5"),
    ([0, 6, 10], 5, 2, 8, "multiple of 2\\*cp"),
    ([0, 8, 12], 6, 2, 7, "freqs has 7 rows, .* need 8"),
    ([0, 3, 14], 14, 1, 10, "freqs has 10 rows, .* need 11"),
])
def test_inconsistent_inputs_are_refused(cu, tokens, cp, rows, match):
    t = torch.zeros(tokens, 1, 4)
    with pytest.raises(ValueError, match=match):
        rope.apply_rotary_pos_emb_thd(t, torch.tensor(cu), torch.zeros(rows, 1, 1, 4), cp_group=_CpGroup(cp, 0))
