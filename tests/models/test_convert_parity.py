"""HF <-> Megatron conversion on gloo ranks: logits parity with transformers, bit-exact round trips,
distributed-checkpoint resharding, and refusals that name what is wrong.

Every multi-rank case runs in freshly spawned processes (tests/helpers/distributed.py). Each rank loads an
HF directory (or a megatron checkpoint) into its pipeline stage, runs megatron's forward-only
schedule, compares the real-vocabulary logits with transformers' Qwen3ForCausalLM, and streams
its stage back to HF tensors that must equal the original safetensors bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.convert import (build_stage, export_kwargs, hf_logits, hf_state, init_rank, layout_kwargs,
                                       make_hf_checkpoint, megatron_logits, tiny_cfg, token_ids)

pytestmark = pytest.mark.integration
TOL = 1e-4


def _phase(ctx, cfg, hf_dir, load_from_ckpt, save_ckpt):
    """Load (HF dir or megatron checkpoint), compare logits, export, optionally save a checkpoint."""
    from mgrpo.models import (iter_megatron_to_hf, load_hf_into_megatron, load_megatron_checkpoint,
                              save_megatron_checkpoint)

    model = build_stage(cfg, ctx)
    if load_from_ckpt:
        load_megatron_checkpoint(model, load_from_ckpt)
    else:
        load_hf_into_megatron(model, hf_dir, cfg, **layout_kwargs(ctx))
    ids = token_ids(cfg)
    logits = megatron_logits(model, ctx, cfg, ids)
    max_diff = None
    if logits is not None:
        ref = hf_logits(hf_dir, ids)
        assert logits.shape == ref.shape, (logits.shape, ref.shape)
        max_diff = (logits - ref).abs().max().item()

    original = hf_state(hf_dir)
    names, unequal = [], []
    for name, tensor in iter_megatron_to_hf(model, cfg, **export_kwargs(ctx)):
        names.append(name)
        if name not in original or not torch.equal(tensor, original[name]):
            unequal.append(name)
    if save_ckpt:
        save_megatron_checkpoint(model, save_ckpt)
    return dict(tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, dp_rank=ctx.dp_rank, max_diff=max_diff, names=names,
                unequal=unequal)


def _rank_phases(rank, world_size, port, phases):
    """Run several layouts one after another in the same processes (re-initialising megatron's
    parallel state between them saves spawning fresh ranks for every layout)."""
    from megatron.core import parallel_state as ps

    out = []
    for tp, pp, cfg, hf_dir, load_from_ckpt, save_ckpt in phases:
        ctx = init_rank(rank, world_size, port, tp, pp)
        out.append(_phase(ctx, cfg, hf_dir, load_from_ckpt, save_ckpt))
        ps.destroy_model_parallel()
    return out


def _check(results, hf_dir, pp):
    """results: one dict per rank for one phase."""
    expected = set(hf_state(hf_dir))
    by_stage: dict[int, list[str]] = {}
    for r in results:
        where = f"pp_rank={r['pp_rank']} tp_rank={r['tp_rank']} dp_rank={r['dp_rank']}"
        assert not r["unequal"], f"{where} not bit-exact: {r['unequal']}"
        # every TP (and DP) rank of a stage iterates the same names in the same order
        assert by_stage.setdefault(r["pp_rank"], r["names"]) == r["names"], where
        if r["max_diff"] is not None:
            assert r["max_diff"] < TOL, f"{where}: logits differ by {r['max_diff']}"
    assert sum(r["max_diff"] is not None for r in results) == len(results) // pp  # last-stage ranks compared
    emitted = [n for s in sorted(by_stage) for n in by_stage[s]]
    assert len(emitted) == len(set(emitted)), "a tensor was emitted by two stages"
    assert set(emitted) == expected


def _run(world_size, phases):
    per_rank = run_ranks(_rank_phases, world_size, phases)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(phases))]


def test_tp2_untied_sharded_then_pp2_tied_then_reshard_to_tp2(tmp_path):
    untied = tiny_cfg()
    sharded = make_hf_checkpoint(str(tmp_path / "untied"), untied, seed=2, max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    tied = tiny_cfg(tie_word_embeddings=True)
    hf_dir = make_hf_checkpoint(str(tmp_path / "tied"), tied, seed=3)
    ckpt = str(tmp_path / "mcore")
    tp2, pp2, resharded = _run(2, [(2, 1, untied, sharded, None, None),
                                   (1, 2, tied, hf_dir, None, ckpt),
                                   # saved at TP1xPP2 (padded vocab 128), loaded at TP2xPP1 (padded vocab 256)
                                   (2, 1, tied, hf_dir, ckpt, None)])
    _check(tp2, sharded, pp=1)
    assert tp2[0]["names"][-1] == "lm_head.weight"
    _check(pp2, hf_dir, pp=2)
    assert pp2[0]["names"][0] == "model.embed_tokens.weight"  # tied: the embedding comes from stage 0 only
    assert "lm_head.weight" not in pp2[1]["names"]
    _check(resharded, hf_dir, pp=1)


def test_tp2pp2_untied_then_reshard_to_tp1_dp4(tmp_path):
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=4)
    ckpt = str(tmp_path / "mcore")
    tp2pp2, dp4 = _run(4, [(2, 2, cfg, hf_dir, None, ckpt), (1, 1, cfg, hf_dir, ckpt, None)])
    _check(tp2pp2, hf_dir, pp=2)
    assert tp2pp2[-1]["names"][-1] == "lm_head.weight"
    assert [r["dp_rank"] for r in dp4] == [0, 1, 2, 3]
    _check(dp4, hf_dir, pp=1)


# ---------------------------------------------------------------------------------------------
# refusals


def _rewrite(src: str, dst: str, edit) -> str:
    """Copy an HF dir, passing its tensors through `edit(dict) -> dict`."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    state = edit(hf_state(src))
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(dst, f))
    save_file(state, os.path.join(dst, "model.safetensors"))
    return dst


def _rank_tp1(rank, world_size, port, tied, tied_dir, cases):
    """TP1 parity of a tied model, then each refusal case: (label, hf_dir, model_cfg, build_cfg) ->
    its error message, and whether the refused load left the weights untouched."""
    from mgrpo.models import load_hf_into_megatron

    ctx = init_rank(rank, world_size, port, 1, 1)
    parity = _phase(ctx, tied, tied_dir, None, None)
    out = {}
    for label, hf_dir, model_cfg, build_cfg in cases:
        model = build_stage(build_cfg, ctx)
        before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        try:
            load_hf_into_megatron(model, hf_dir, model_cfg, **layout_kwargs(ctx))
            out[label] = None
        except (ValueError, FileNotFoundError) as e:
            out[label] = str(e)
        after = model.state_dict()
        out[label + ":untouched"] = all(torch.equal(v, after[k]) for k, v in before.items())
    return parity, out


def test_tp1_tied_and_wrong_checkpoints_refused_by_name(tmp_path):
    import dataclasses

    tied = tiny_cfg(tie_word_embeddings=True)
    tied_dir = make_hf_checkpoint(str(tmp_path / "tied"), tied, seed=1)
    cfg = tiny_cfg()
    good = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=5)
    up = "model.layers.1.mlp.up_proj.weight"
    missing = _rewrite(good, str(tmp_path / "missing"), lambda s: {k: v for k, v in s.items() if k != up})
    misshaped = _rewrite(good, str(tmp_path / "misshaped"),
                         lambda s: {**s, "model.layers.2.self_attn.k_proj.weight": torch.zeros(24, 64)})
    extra = _rewrite(good, str(tmp_path / "extra"), lambda s: {**s, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    quantized = _rewrite(good, str(tmp_path / "int"),
                         lambda s: {**s, "model.norm.weight": torch.zeros(64, dtype=torch.int8)})
    wrong_cfg = dataclasses.replace(cfg, num_query_groups=4)
    bigger_ffn = dataclasses.replace(cfg, ffn_hidden_size=128)
    cases = [("missing", missing, cfg, cfg), ("misshaped", misshaped, cfg, cfg), ("extra", extra, cfg, cfg),
             ("config", good, wrong_cfg, wrong_cfg), ("model", good, cfg, bigger_ffn),
             ("nodir", str(tmp_path / "nope"), cfg, cfg), ("dtype", quantized, cfg, cfg)]
    parity, msg = run_ranks(_rank_tp1, 1, tied, tied_dir, cases)[0]

    _check([parity], tied_dir, pp=1)
    assert "lm_head.weight" not in parity["names"]

    assert up in msg["missing"] and "decoder.layers.1.mlp.linear_fc1.weight" in msg["missing"]
    assert "model.layers.2.self_attn.k_proj.weight has shape [24, 64]" in msg["misshaped"]
    assert "expected [48, 64]" in msg["misshaped"]
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in msg["misshaped"]
    assert "unexpected tensor model.layers.9.mlp.up_proj.weight" in msg["extra"]
    assert "config.json num_key_value_heads=2 but model.num_query_groups=4" in msg["config"]
    assert "decoder.layers.0.mlp.linear_fc1.weight has shape [256, 64], expected [192, 64]" in msg["model"]
    assert "does not exist" in msg["nodir"]
    assert "model.norm.weight has dtype I8" in msg["dtype"]
    for label, *_ in cases:
        assert msg[label] is not None, label
        assert msg[label + ":untouched"], f"{label}: a refused load changed the weights"
