"""A second model family, registered beside Qwen3, is what `model.family` picks everywhere.

The toy family is Llama-shaped: Qwen3 without the q/k RMSNorms, which is what transformers'
LlamaForCausalLM is (with an explicit head_dim and no biases). It is declared in this file the way a
new family module would be under mgrpo/models/, and checked against transformers' own Llama: the
validator accepts the name only while it is registered, the planner's parameter count equals
transformers', the Megatron config and layer spec drop the q/k norms, and an HF checkpoint written,
loaded into a Megatron stage and streamed back gives transformers' logits and its exact tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mgrpo.config import ConfigError, MGRPOConfig
from mgrpo.preflight import preflight
from mgrpo.models import qwen3
from mgrpo.models.registry import FAMILIES, family_of, param_counts
from tests.helpers.distributed import run_ranks
from tests.helpers.convert import build_stage, init_rank, layout_kwargs, megatron_logits, tiny_cfg, token_ids

TOY = "toy_llama"
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _megatron_config(model) -> dict:
    return {**qwen3.megatron_config(model), "qk_layernorm": False}


def _layer_spec(use_te: bool, model=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert not use_te, "the toy family runs on CPU only"
    return get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")


def _hf_shapes(cfg) -> dict:
    return {k: s for k, s in qwen3.hf_shapes(cfg).items() if not k.endswith(QK_NORMS)}


def _stage_weights(cfg, **kw) -> list:
    return [w for w in qwen3.stage_weights(cfg, **kw) if not w.hf[0].endswith(QK_NORMS)]


def _hf_config(model, *, dtype: str = "float32", **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                       intermediate_size=model.ffn_hidden_size, num_hidden_layers=model.num_layers,
                       num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
                       head_dim=model.head_dim, max_position_embeddings=model.max_position_embeddings,
                       rms_norm_eps=model.rms_norm_eps, rope_theta=model.rope_theta,
                       tie_word_embeddings=model.tie_word_embeddings, initializer_range=model.init_std,
                       hidden_act="silu", attention_bias=False, mlp_bias=False, dtype=dtype, **extra)


def _hf_parse(raw: dict):
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(raw)


def _hf_model(config):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def _layer_params(m):
    p = qwen3.layer_params(m)
    return dataclasses.replace(p, replicated={"norms": 2 * m.hidden_size})


TOY_FAMILY = dataclasses.replace(
    qwen3.QWEN3, name=TOY, hf_model_type="llama", hf_architecture="LlamaForCausalLM",
    megatron_config=_megatron_config, megatron_layer_spec=_layer_spec, hf_shapes=_hf_shapes,
    stage_weights=_stage_weights, hf_config=_hf_config, hf_parse_config=_hf_parse, hf_model=_hf_model,
    hf_unsupported=lambda cfg, path: [], layer_params=_layer_params, default_tokenizer=lambda vocab: "synthetic")


@pytest.fixture
def toy():
    FAMILIES.register(TOY, TOY_FAMILY)
    yield tiny_cfg(family=TOY)
    FAMILIES.unregister(TOY)


def test_validator_accepts_a_family_only_while_it_is_registered(toy):
    cfg = dataclasses.replace(MGRPOConfig(), model=toy)
    preflight(cfg, check_memory=False)
    assert family_of(toy) is TOY_FAMILY
    FAMILIES.unregister(TOY)
    try:
        with pytest.raises(ConfigError, match=r"model.family='toy_llama' is not one of \['qwen3', 'qwen3_moe'\]"):
            preflight(cfg, check_memory=False)
    finally:
        FAMILIES.register(TOY, TOY_FAMILY)


def test_param_counts_follow_the_family(toy):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(_hf_config(toy))
    counts = param_counts(toy)  # what mgrpo-plan reports
    assert counts["hf_total"] == sum(p.numel() for p in hf.parameters()) == sum(
        torch.Size(s).numel() for s in _hf_shapes(toy).values())
    qwen = param_counts(dataclasses.replace(toy, family="qwen3"))
    assert qwen["hf_total"] - counts["hf_total"] == toy.num_layers * 2 * toy.head_dim  # the q/k norms


def test_megatron_config_and_spec_follow_the_family(toy):
    from mgrpo.models.gpt import transformer_config

    assert transformer_config(toy, use_cpu=True).qk_layernorm is False
    assert transformer_config(dataclasses.replace(toy, family="qwen3"), use_cpu=True).qk_layernorm is True


def _rank_round_trip(rank, world_size, port, cfg, hf_dir):
    """On one gloo rank: the HF directory into a Megatron stage built for the family, logits, and back."""
    from transformers import AutoModelForCausalLM

    from mgrpo.models import iter_megatron_to_hf, load_hf_into_megatron

    FAMILIES.register(TOY, TOY_FAMILY, replace=True)  # this process imported the registry afresh
    ctx = init_rank(rank, world_size, port, tp=1, pp=1)
    model = build_stage(cfg, ctx)
    params = sorted(k for k, p in model.named_parameters() if p.numel())
    load_hf_into_megatron(model, hf_dir, cfg, **layout_kwargs(ctx))
    ids = token_ids(cfg)
    logits = megatron_logits(model, ctx, cfg, ids)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    exported = dict(iter_megatron_to_hf(model, cfg, tp_group=ctx.tp_group, tp_size=1, pp_rank=0, pp_size=1))
    from safetensors.torch import load_file

    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    return dict(max_diff=(logits - ref).abs().max().item(), ref_scale=ref.abs().max().item(), params=params,
                same=sorted(exported) == sorted(original) and all(torch.equal(exported[k], original[k])
                                                                   for k in original))


@pytest.mark.integration
def test_hf_checkpoint_round_trip_through_megatron(toy, tmp_path):
    from mgrpo.models import check_hf_config, init_hf_checkpoint, model_config_from_hf

    hf_dir = init_hf_checkpoint(str(tmp_path / "toy"), toy, seed=3)
    with open(os.path.join(hf_dir, "config.json")) as f:
        written = json.load(f)
    assert (written["model_type"], written["architectures"]) == ("llama", ["LlamaForCausalLM"])
    back = model_config_from_hf(hf_dir)  # the family is found from config.json's model_type
    assert back.family == TOY and back.head_dim == toy.head_dim and back.num_query_groups == toy.num_query_groups
    check_hf_config(hf_dir, toy)
    with pytest.raises(ValueError, match=r"model_type='llama', expected 'qwen3' \(model.family='qwen3'\)"):
        check_hf_config(hf_dir, dataclasses.replace(toy, family="qwen3"))

    (res,) = run_ranks(_rank_round_trip, 1, toy, hf_dir)
    assert not any("layernorm" in p and ("q_" in p or "k_" in p) for p in res["params"]), res["params"]
    assert res["ref_scale"] > 0.1 and res["max_diff"] < 1e-4, res
    assert res["same"]
