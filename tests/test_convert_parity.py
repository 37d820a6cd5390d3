"""HF <-> Megatron conversion on gloo ranks: logits parity with transformers, bit-exact round trips,
distributed-checkpoint resharding, and refusals that name what is wrong.

Every multi-rank case runs in freshly spawned processes (tests/distributed.py). Each rank loads an
HF directory (or a megatron checkpoint) into its pipeline stage, runs megatron's forward-only
schedule, compares the real-vocabulary logits with transformers' Qwen3ForCausalLM, and streams
its stage back to HF tensors that must equal the original safetensors bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_convert_common import (build_stage, export_kwargs, hf_logits, hf_state, init_rank, layout_kwargs,
                                       make_hf_checkpoint, megatron_logits, tiny_cfg, token_ids)

pytestmark = pytest.mark.dist
TOL = 1e-4


def _rank_parity(rank, world_size, port, tp, pp, cfg, hf_dir, load_from_ckpt, save_ckpt):
    """Load (HF dir or megatron checkpoint), compare logits, export, optionally save a checkpoint."""
    from mgrpo.models import (iter_megatron_to_hf, load_hf_into_megatron, load_megatron_checkpoint,
                              save_megatron_checkpoint)

    ctx = init_rank(rank, world_size, port, tp, pp)
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
    return dict(tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, max_diff=max_diff, names=names, unequal=unequal)


def _check(results, hf_dir, pp):
    expected = set(hf_state(hf_dir))
    by_stage: dict[int, list[str]] = {}
    for r in results:
        assert not r["unequal"], f"pp_rank={r['pp_rank']} tp_rank={r['tp_rank']} not bit-exact: {r['unequal']}"
        # every TP rank of a stage iterates the same names in the same order
        assert by_stage.setdefault(r["pp_rank"], r["names"]) == r["names"]
        if r["max_diff"] is not None:
            assert r["max_diff"] < TOL, f"logits differ by {r['max_diff']}"
    assert sum(r["max_diff"] is not None for r in results) == len(results) // pp  # last-stage ranks compared
    emitted = [n for s in sorted(by_stage) for n in by_stage[s]]
    assert len(emitted) == len(set(emitted)), "a tensor was emitted by two stages"
    assert set(emitted) == expected


def test_tp1_tied(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True)
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=1)
    results = run_ranks(_rank_parity, 1, 1, 1, cfg, hf_dir, None, None)
    _check(results, hf_dir, pp=1)
    assert "lm_head.weight" not in results[0]["names"]


def test_tp2_untied_sharded_checkpoint(tmp_path):
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=2, max_shard_size="100KB")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    _check(run_ranks(_rank_parity, 2, 2, 1, cfg, hf_dir, None, None), hf_dir, pp=1)


def test_pp2_tied_then_reshard_to_tp2(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True)
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=3)
    ckpt = str(tmp_path / "mcore")
    results = run_ranks(_rank_parity, 2, 1, 2, cfg, hf_dir, None, ckpt)
    _check(results, hf_dir, pp=2)
    assert results[0]["names"][0] == "model.embed_tokens.weight"  # tied: the embedding comes from stage 0
    assert "lm_head.weight" not in results[1]["names"]
    # saved at TP1xPP2 (padded vocab 128), loaded at TP2xPP1 (padded vocab 256)
    _check(run_ranks(_rank_parity, 2, 2, 1, cfg, hf_dir, ckpt, None), hf_dir, pp=1)


def test_tp2pp2_untied_then_reshard_to_tp1(tmp_path):
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=4)
    ckpt = str(tmp_path / "mcore")
    results = run_ranks(_rank_parity, 4, 2, 2, cfg, hf_dir, None, ckpt)
    _check(results, hf_dir, pp=2)
    assert results[-1]["names"][-1] == "lm_head.weight"
    _check(run_ranks(_rank_parity, 1, 1, 1, cfg, hf_dir, ckpt, None), hf_dir, pp=1)


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


def _rank_refusals(rank, world_size, port, cfg, cases):
    """Try each (label, hf_dir, model_cfg, build_cfg) and return its error message; also check
    that a refused load left the weights untouched."""
    from mgrpo.models import load_hf_into_megatron

    ctx = init_rank(rank, world_size, port, 1, 1)
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
    return out


def test_wrong_checkpoints_are_refused_by_name(tmp_path):
    import dataclasses

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
    msg = run_ranks(_rank_refusals, 1, cfg, cases)[0]
    assert up in msg["missing"] and "decoder.layers.1.mlp.linear_fc1.weight" in msg["missing"]
    assert "model.layers.2.self_attn.k_proj.weight has shape [24, 64]" in msg["misshaped"]
    assert "expected [48, 64]" in msg["misshaped"]
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in msg["misshaped"]
    assert "unexpected tensor model.layers.9.mlp.up_proj.weight" in msg["extra"]
    assert "config.json num_key_value_heads=2 but model.num_query_groups=4" in msg["config"]
    assert "decoder.layers.0.mlp.linear_fc1.weight has shape [256, 64], expected [192, 64]" in msg["model"]
    assert "does not exist" in msg["nodir"]
    assert "model.norm.weight has dtype I8" in msg["dtype"]
    for label in ("missing", "misshaped", "extra", "config", "model", "nodir", "dtype"):
        assert msg[label] is not None, label
        assert msg[label + ":untouched"], f"{label}: a refused load changed the weights"
