"""Context parallelism on CPU: the reference attention's CP exchange against plain causal attention,
its fused padded-bucket computation against the einsum definition (CP 1 and 2, packed and padded, GQA),
CP=2 against CP=1 on the real MegatronActor (padded and packed; log-probs, loss, gradient norm within
1e-5), weight sync and checkpoints from CP ranks, and the validator's refusals."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.packing import answer, assert_same_run, max_diff, rank_runs, run_config

pytestmark = pytest.mark.integration

SEQS = [8, 12, 4]  # global slots of three packed sequences (multiples of 2*cp = 4)
HEADS, GROUPS, DIM = 4, 2, 8


def _dense(q, k, v):
    """Independent reference: torch's SDPA with its own causal mask, one sequence at a time."""
    outs, start = [], 0
    for n in SEQS:
        sl = slice(start, start + n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def _rank_attention(rank, world, port):
    """Every rank draws the same global q, k, v and output weights; each runs the reference attention
    on its CP share (THD-packed, then as padded rows of one sequence each) and returns its output and
    input gradients next to the dense reference's at the same positions."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mgrpo.models.attention import ReferenceCoreAttention
    from mgrpo.models.attention_layout import cp_positions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=HEADS, num_query_groups=GROUPS,
                               kv_channels=DIM, attention_dropout=0.0, use_cpu_initialization=True)
    pgs = types.SimpleNamespace(tp=dist.group.WORLD, cp=dist.group.WORLD)
    attn = ReferenceCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs)
    g = torch.Generator().manual_seed(0)
    total = sum(SEQS)
    q, k, v = (torch.randn(total, h, DIM, generator=g) for h in (HEADS, GROUPS, GROUPS))
    w = torch.randn(total, HEADS, DIM, generator=g)
    # this rank's tokens: per sequence, its two chunks, as the batch builder lays them out
    starts = torch.tensor([0] + SEQS).cumsum(0)
    mine = torch.cat([starts[i] + cp_positions(n, world, rank) for i, n in enumerate(SEQS)])

    def run(fn, *xs):
        xs = [x.clone().requires_grad_(True) for x in xs]
        out = fn(*xs)
        (out * w_of(out)).sum().backward()
        return out.detach(), [x.grad for x in xs]

    cu = torch.tensor([0] + SEQS).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=max(SEQS), max_seqlen_kv=max(SEQS))
    w_of = lambda out: w if out.shape[0] == total else w[mine]  # noqa: E731
    dense_out, dense_grads = run(_dense, q, k, v)
    thd_out, thd_grads = run(lambda a, b, c: attn(a, b, c, None, packed_seq_params=psp).view(-1, HEADS, DIM),
                             q[mine], k[mine], v[mine])
    # padded rows: the 8-slot sequence alone as a [s_local, b=1] batch
    row = cp_positions(8, world, rank)
    rows_out = attn(q[row].unsqueeze(1), k[row].unsqueeze(1), v[row].unsqueeze(1), None)
    dist.destroy_process_group()
    return dict(out=(thd_out - dense_out[mine]).abs().max().item(),
                grads=[(a - b[mine]).abs().max().item() for a, b in zip(thd_grads, dense_grads)],
                rows=(rows_out.view(-1, HEADS, DIM) - dense_out[row]).abs().max().item(),
                scale_of_grads=max(gr.abs().max().item() for gr in dense_grads))


def test_reference_attention_cp_exchange_is_exact():
    for r in run_ranks(_rank_attention, 2):
        assert r["out"] < 1e-5 and r["rows"] < 1e-5, r
        assert r["scale_of_grads"] > 0.1 and max(r["grads"]) < 1e-5, r  # q, k and v gradients, k/v summed over ranks


# lengths (multiples of 2*cp = 4, plus an empty one) that make several padded buckets and a lone one:
# [40], [16, 12], [8, 8, 4], [4] (mgrpo.models.attention.buckets_by_length)
MIXED = [8, 12, 4, 16, 4, 8, 40, 0]


def _einsum_dense(q, k, v, seqs, scale):
    """The readable reference, per sequence over all its positions."""
    from mgrpo.models.attention import causal_attention_reference

    outs, start = [], 0
    for n in seqs:
        sl = slice(start, start + n)
        outs.append(causal_attention_reference(q[sl][None], k[sl][None], v[sl][None], torch.arange(n), scale)[0])
        start += n
    return torch.cat(outs)


def _rank_fused_vs_einsum(rank, world, port):
    """`ReferenceCoreAttention` (fused attention over padded buckets) against the einsum reference on
    CP=1 (a one-rank gloo group per rank) and CP=2 (both ranks): packed THD of mixed lengths and padded
    [s, b] rows, grouped-query and plain multi-head; outputs and q/k/v gradients, relative to their size."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mgrpo.models.attention import ReferenceCoreAttention
    from mgrpo.models.attention_layout import cp_positions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    errors = {}
    for (cp, group), groups, packed in [((c, g), gr, p) for c, g in ((1, alone), (2, dist.group.WORLD))
                                        for gr in (GROUPS, HEADS) for p in (True, False)]:
        seqs = MIXED if packed else [8] * 3
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=HEADS, num_query_groups=groups,
                                   kv_channels=DIM, attention_dropout=0.0, use_cpu_initialization=True)
        attn = ReferenceCoreAttention(config, 1, AttnMaskType.causal, "self",
                                      pg_collection=types.SimpleNamespace(tp=group, cp=group))
        g = torch.Generator().manual_seed(1)
        total = sum(seqs)
        q, k, v = (torch.randn(total, h, DIM, generator=g) for h in (HEADS, groups, groups))
        w = torch.randn(total, HEADS, DIM, generator=g)
        starts = torch.tensor([0] + seqs).cumsum(0)
        mine = torch.cat([starts[i] + cp_positions(n, cp, rank % cp) for i, n in enumerate(seqs)])
        cu = starts.to(torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                              cu_seqlens_kv_padded=cu, max_seqlen_q=max(seqs), max_seqlen_kv=max(seqs))

        def ours(a, b, c):
            if packed:
                return attn(a, b, c, None, packed_seq_params=psp).view(-1, HEADS, DIM)
            rows = lambda x: x.view(3, -1, *x.shape[1:]).transpose(0, 1)  # noqa: E731  [s_local, b, ...]
            return attn(rows(a), rows(b), rows(c), None).view(-1, 3, HEADS, DIM).transpose(0, 1).reshape(-1, HEADS, DIM)

        xs = [x[mine].clone().requires_grad_(True) for x in (q, k, v)]
        out = ours(*xs)
        (out * w[mine]).sum().backward()
        ys = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = _einsum_dense(*ys, seqs, attn.scale)
        (ref * w).sum().backward()
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()  # noqa: E731
        errors[f"cp{cp}-{'gqa' if groups < HEADS else 'mha'}-{'packed' if packed else 'padded'}"] = (
            [rel(out.detach(), ref.detach()[mine])] + [rel(x.grad, y.grad[mine]) for x, y in zip(xs, ys)])
    dist.destroy_process_group()
    return errors


def test_buckets_pad_only_similar_lengths():
    from mgrpo.models.attention import buckets_by_length

    assert buckets_by_length(MIXED) == [[6], [3, 1], [0, 5, 2], [4]]  # the empty sequence 7 in none
    by_length = [list(range(first, 150, 3)) for first in (2, 1, 0)]  # 8s, 7s, 6s: one padded bucket
    assert buckets_by_length([6, 7, 8] * 50) == [by_length[0] + by_length[1] + by_length[2]]
    assert buckets_by_length([1000, 10, 10]) == [[0], [1, 2]]


def test_fused_attention_matches_the_einsum_reference():
    for errors in run_ranks(_rank_fused_vs_einsum, 2):
        assert len(errors) == 8
        for case, errs in errors.items():
            assert max(errs) < 1e-6, (case, errs)  # output, then q, k, v gradients


# ---------------------------------------------------------------------------------------------
# the real trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """CP=1 (one rank, padded) as the reference; CP=2 padded and packed on two ranks, the packed run
    saving its megatron checkpoint and HF export; then CP=1 (one rank) resuming that checkpoint."""
    from mgrpo.models import init_hf_checkpoint

    tmp = tmp_path_factory.mktemp("cp")
    hf_dir = init_hf_checkpoint(str(tmp / "hf"), run_config().model, seed=3)
    ref, ref_tail = run_ranks(rank_runs, 1, hf_dir, [dict(budget=40, save=str(tmp / "cp1")), dict(tail=True)])[0]
    res = run_ranks(rank_runs, 2, hf_dir, [dict(cp=2, budget=24), dict(cp=2, packed=True, budget=24,
                                                                       save=str(tmp / "cp2")),
                                           dict(cp=2, tail=True)])
    (resumed,) = run_ranks(rank_runs, 1, hf_dir, [dict(load=str(tmp / "cp2"))])[0]
    return dict(tmp=tmp, ref=ref, cp2=[r[0] for r in res], cp2_packed=[r[1] for r in res], resumed=resumed,
                ref_tail=ref_tail, cp2_tail=[r[2] for r in res])


def test_cp2_reproduces_cp1(runs):
    ref = runs["ref"]
    assert ref["metrics"]["actor/grad_norm"] > 0.1
    for key in ("cp2", "cp2_packed"):
        ranks = runs[key]
        assert [r["info"]["cp_rank"] for r in ranks] == [0, 1] and {r["info"]["dp_rank"] for r in ranks} == {0}
        got = answer(ranks)  # log-probs come back from cp_rank 0, in sample order
        assert got["info"]["cp_rank"] == 0
        assert_same_run(got, ref, label=key)
        same = lambda m: {k: v for k, v in m.items() if not k.startswith("timing_s/")}  # noqa: E731
        assert same(ranks[0]["metrics"]) == same(ranks[1]["metrics"])  # every CP rank reports the sums
        assert len(got["micro_batches"]) > 1  # a 24-slot budget per rank: several micro-batches


def test_cp_rank_without_response_tokens(runs):
    """All responses in CP rank 0's chunks: rank 1 computes no loss term but still runs the forward and
    backward (its attention exchange), reports the same metric sums, and nothing changes."""
    ranks = runs["cp2_tail"]
    assert [r["local_tokens"] for r in ranks] == [8, 0]
    got, want = answer(ranks), runs["ref_tail"]
    # Log-probs before the update, the reference's, and the step's loss metrics and gradient norm at 1e-5.
    # The log-probs after it at 1e-3: this batch's 8 response tokens leave many weight gradients near zero,
    # where Adam's first step (about lr * sign(gradient), lr=1e-2) turns fp32 rounding into lr-sized moves;
    # the same CP=1 packed run with the einsum attention and with the fused one (no CP at all) differ by
    # 2e-4 after the step, 2.4e-7 before it.
    assert_same_run(dict(got, after=want["after"]), want, label="tail")
    assert max_diff(got["after"]["logprobs"], want["after"]["logprobs"]) < 1e-3


def test_cp_ranks_sync_and_save_the_same_weights(runs):
    """Only CP rank 0 sends weights; they are the CP=1 run's trained weights; the CP=2 checkpoint
    resumes at CP=1 with the trained weights (its first log-probs are the CP=2 run's after-update ones)."""
    from transformers import AutoModelForCausalLM

    ref, ranks = runs["ref"], runs["cp2_packed"]
    assert ranks[1]["synced"] == {} and set(ranks[0]["synced"]) == set(ref["synced"])
    assert max(abs(ranks[0]["synced"][n] - ref["synced"][n]) for n in ref["synced"]) < 1e-3
    a = AutoModelForCausalLM.from_pretrained(str(runs["tmp"] / "cp1-hf")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(runs["tmp"] / "cp2-hf")).state_dict()
    # Adam's first step is about lr * sign(gradient), so fp32 rounding in tiny gradients shows at 1e-5
    # here (the e2e layout tests allow 1e-4 for the same reason)
    assert a.keys() == b.keys() and max((a[n] - b[n]).abs().max().item() for n in a) < 1e-4
    assert max_diff(runs["resumed"]["before"]["logprobs"], answer(ranks)["after"]["logprobs"]) < 1e-5


@pytest.mark.system
def test_tp2_cp2_and_pp2_cp2_packed_reproduce_cp1(runs, tmp_path):
    """Four ranks: TP=2 x CP=2, then PP=2 x CP=2 (several packs of different lengths through the
    pipeline, each split over the CP ranks of its stage)."""
    hf_dir = str(runs["tmp"] / "hf")
    res = run_ranks(rank_runs, 4, hf_dir, [dict(tp=2, cp=2, packed=True, budget=24),
                                           dict(pp=2, cp=2, packed=True, budget=24)], timeout_s=600)
    assert sorted((r[0]["info"]["tp_rank"], r[0]["info"]["cp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted((r[1]["info"]["pp_rank"], r[1]["info"]["cp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_same_run(answer([r[0] for r in res]), runs["ref"], label="tp2xcp2")
    pp2cp2 = answer([r[1] for r in res])
    assert len(pp2cp2["micro_batches"]) > 1
    assert_same_run(pp2cp2, runs["ref"], label="pp2xcp2")


# ---------------------------------------------------------------------------------------------
# validation


def _validate(**groups):
    from mgrpo.config import MGRPOConfig
    from mgrpo.preflight import preflight

    cfg = MGRPOConfig()
    for group, fields in {"trainer": {"device": "cpu"}, **groups}.items():
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})
    return preflight(cfg, check_files=False, check_memory=False).layout


def test_validation_accepts_cp_on_cpu_and_refuses_what_cannot_work():
    assert _validate(actor={"cp": 2}).megatron_world == 2
    assert _validate(actor={"cp": 2, "tp": 2, "pp": 2, "pack_sequences": True}).megatron_world == 8
    with pytest.raises(ValueError, match=r"actor.cp=2 splits every response.*policy_loss='gspo' is sequence-level"):
        _validate(actor={"cp": 2}, algorithm={"policy_loss": "gspo"})
    with pytest.raises(ValueError, match=r"actor.cp_comm_type='a2a'.*num_attention_heads/actor.tp=1 is not divisible"):
        _validate(actor={"cp": 2, "tp": 4, "cp_comm_type": "a2a"})
    with pytest.raises(ValueError, match=r"actor.cp_comm_type='ring' is not one of"):
        _validate(actor={"cp_comm_type": "ring"})
