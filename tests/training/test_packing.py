"""Packed (THD) micro-batches: the layout by hand, the packer, FP8 shapes, and packed vs padded training
on the real MegatronActor at TP=1, TP=2 and PP=2 (log-probs, loss and gradient norm within 1e-5)."""

from __future__ import annotations

import pytest
import torch

from mgrpo.data.packing import pack_by_tokens, pack_micro_batches
from mgrpo.training.batch import RankBatch, batch_layout, build_micro_batch, fp8_token_multiple
from tests.helpers.distributed import run_ranks
from tests.helpers.packing import answer, assert_same_run, rank_runs, run_config

# three samples: prompt lengths 2, 1, 3; responses 3, 2, 4 tokens
BATCH = RankBatch(input_ids=[[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]], prompt_lens=[2, 1, 3],
                  seq_index=[7, 8, 9], advantages=[[0.1, 0.2, 0.3], [0.4, 0.5], [0.6, 0.7, 0.8, 0.9]])


def test_padded_and_packed_layouts_by_hand():
    pad = build_micro_batch(BATCH, batch_layout(packed=False))
    assert pad.tokens.tolist() == [[11, 12, 13, 14, 15, 0, 0], [21, 22, 23, 0, 0, 0, 0],
                                   [31, 32, 33, 34, 35, 36, 37]]
    assert pad.packed_seq_params is None and pad.slots == 21
    # hidden state t predicts token t + 1: rows of 7, so sample 1's first response token (index 1)
    # is predicted at flat position 7 + 0
    assert pad.positions.tolist() == [1, 2, 3, 7, 8, 16, 17, 18, 19]

    pk = build_micro_batch(BATCH, batch_layout(packed=True))
    assert pk.tokens.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, 35, 36, 37]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]  # restart per sample
    assert pk.positions.tolist() == [1, 2, 3, 5, 6, 10, 11, 12, 13] and pk.slots == 15
    p = pk.packed_seq_params
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 5, 8, 15] and p.max_seqlen_q == 7
    for mb in (pad, pk):  # the per-token fields are the same tokens in the same order
        assert mb.labels.tolist() == [13, 14, 15, 22, 23, 34, 35, 36, 37]
        assert mb.fields["advantages"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
        assert mb.fields["seq_index"].tolist() == [7, 7, 7, 8, 8, 9, 9, 9, 9]
        assert mb.sample_of_token.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
        assert mb.response_lens == [3, 2, 4] and mb.token_order is None


def test_context_parallel_split_by_hand():
    """cp=2: each sample padded to a multiple of 4, cut in 4 chunks; rank 0 holds chunks 0 and 3,
    rank 1 chunks 1 and 2, with their global positions; between them they hold every response token
    exactly once, each with its own label and fields."""
    per_rank = [build_micro_batch(BATCH, batch_layout(packed=True, cp=2, cp_rank=r)) for r in (0, 1)]
    r0, r1 = per_rank
    # sample 0 (5 tokens -> 8 slots, chunks of 2): rank 0 gets positions 0,1,6,7; rank 1 gets 2,3,4,5
    assert r0.tokens.tolist()[0][:4] == [11, 12, 0, 0] and r1.tokens.tolist()[0][:4] == [13, 14, 15, 0]
    assert r0.position_ids.tolist()[0][:4] == [0, 1, 6, 7] and r1.position_ids.tolist()[0][:4] == [2, 3, 4, 5]
    assert r0.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 20]  # global slots
    assert r0.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 8, 15]  # real lengths
    assert r0.tokens.shape == r1.tokens.shape == (1, 10)
    order = torch.cat([r0.token_order, r1.token_order])
    assert sorted(order.tolist()) == list(range(9))
    labels = torch.empty(9, dtype=torch.long)
    adv = torch.empty(9)
    for mb in per_rank:
        labels[mb.token_order] = mb.labels
        adv[mb.token_order] = mb.fields["advantages"]
    assert labels.tolist() == [13, 14, 15, 22, 23, 34, 35, 36, 37]
    assert adv.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    # padded rows under cp=2: width 8 (7 rounded up to 4), 4 slots per rank per row
    r1_pad = build_micro_batch(BATCH, batch_layout(packed=False, cp=2, cp_rank=1))
    assert r1_pad.tokens.tolist() == [[13, 14, 15, 0], [23, 0, 0, 0], [33, 34, 35, 36]]
    assert r1_pad.position_ids.tolist() == [[2, 3, 4, 5]] * 3


@pytest.mark.parametrize("recipe,per_seq,total", [("delayed", 16, 16), ("tensorwise", 16, 16), ("mxfp8", 32, 32),
                                                  ("blockwise", 16, 128)])
@pytest.mark.parametrize("cp", [1, 2])
def test_fp8_shapes(recipe, per_seq, total, cp):
    """actor.fp8: every packed sequence a multiple of 16 slots (32 for MXFP8) and this rank's tokens per
    micro-batch a multiple of what TE's FP8 GEMMs take; padded rows likewise."""
    assert fp8_token_multiple(recipe) == total
    for packed in (True, False):
        labels = 0
        for r in range(cp):
            mb = build_micro_batch(BATCH, batch_layout(packed=packed, cp=cp, cp_rank=r, fp8_recipe=recipe))
            labels += mb.labels.numel()
            assert mb.tokens.numel() % total == 0 and mb.tokens.numel() == mb.slots, (packed, mb.tokens.shape)
            if packed:
                lens = torch.diff(mb.packed_seq_params.cu_seqlens_q_padded)
                assert all(n % per_seq == 0 and n % (2 * cp) == 0 for n in lens.tolist()), lens
                assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 8, 15]
            else:
                assert mb.tokens.shape[1] % total == 0
        assert labels == 9  # padding adds slots, never response tokens
    # no FP8: no padding at all in THD
    assert build_micro_batch(BATCH, batch_layout(packed=True)).slots == 15


def test_pack_by_tokens_fills_the_budget():
    lengths = [30, 5, 17, 9, 28, 3, 12]
    groups = pack_by_tokens(lengths, 40)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    # first-fit decreasing by hand: 30 | 28 | 17, then 12 joins 28, 9 joins 30, 5 and 3 join 17
    assert groups == [[0, 3], [4, 6], [1, 2, 5]]
    # the padded packer needs more micro-batches for the same budget (count x longest <= 40)
    assert len(pack_micro_batches(lengths, 40)) > len(groups)
    assert pack_by_tokens([50, 3], 40) == [[0], [1]]  # an over-budget sample runs alone
    with pytest.raises(ValueError, match="max_tokens=0"):
        pack_by_tokens([1], 0)


# ---------------------------------------------------------------------------------------------
# the real trainer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from mgrpo.models import init_hf_checkpoint

    return init_hf_checkpoint(str(tmp_path_factory.mktemp("hf")), run_config().model, seed=3)


@pytest.mark.integration
def test_packed_matches_padded_tp1(hf_dir):
    """A 40-token budget cuts the 8 samples into 3 padded micro-batches and 2 packed ones; the
    log-probs (before and after one optimizer step, and the reference's), the loss and the gradient
    norm agree."""
    pad, pk = run_ranks(rank_runs, 1, hf_dir, [dict(budget=40), dict(budget=40, packed=True)])[0]
    assert len(pad["micro_batches"]) > len(pk["micro_batches"]) > 1
    assert all(shape[0] == 1 for shape in pk["micro_batches"])
    assert pad["metrics"]["actor/grad_norm"] > 0.1  # a real gradient to compare
    assert_same_run(pk, pad, label="tp1")


@pytest.mark.integration
@pytest.mark.system
def test_packed_matches_padded_tp2_and_pp2(hf_dir):
    layouts = [dict(tp=2), dict(tp=2, packed=True), dict(pp=2, budget=40), dict(pp=2, budget=40, packed=True)]
    res = run_ranks(rank_runs, 2, hf_dir, layouts)
    tp2, tp2_packed, pp2, pp2_packed = (answer([res[r][i] for r in range(2)]) for i in range(len(layouts)))
    assert_same_run(tp2_packed, tp2, label="tp2")
    assert_same_run(pp2_packed, pp2, label="pp2")
    assert len(pp2_packed["micro_batches"]) > 1  # several packs of different lengths through the pipeline


def test_split_per_sample_inverts_the_flattening():
    from mgrpo.training.batch import split_per_sample

    values = torch.arange(9, dtype=torch.float64, requires_grad=True) * 0.5
    assert split_per_sample(values, [2, 0, 3, 4]) == [[0.0, 0.5], [], [1.0, 1.5, 2.0], [2.5, 3.0, 3.5, 4.0]]
    with pytest.raises(ValueError, match="9 values for responses of 8 tokens"):
        split_per_sample(values, [4, 4])
