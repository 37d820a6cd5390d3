"""Qwen3 as a megatron model: the configuration it builds on CPU and for the GPU (Transformer
Engine, FP8, THD packing), the capability checks that choose between them, and the presets."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import sys
import types

import pytest
import torch
import yaml

from mgrpo.config import ModelConfig
from mgrpo.models import capability
from mgrpo.models.gpt import fp8_kwargs, packed_seq_params, transformer_config, transformer_config_kwargs
from mgrpo.models.qwen3 import QWEN3, hf_shapes
from mgrpo.models.shapes import padded_vocab_size
from tests.helpers import ROOT

layer_spec = QWEN3.layer_spec

REPO = str(ROOT)
CFG = ModelConfig(vocab_size=100, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                  head_dim=24, ffn_hidden_size=96)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_cpu_transformer_config_is_qwen3():
    c = transformer_config(CFG, tp=2, pp=2, use_cpu=True)
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size) == (4, 64, 96)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (4, 2, 24)  # head_dim != 64/4
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == CFG.rms_norm_eps
    assert c.qk_layernorm and c.gated_linear_unit and c.activation_func is torch.nn.functional.silu
    assert not c.add_bias_linear and not c.add_qkv_bias
    assert c.use_cpu_initialization and not c.apply_rope_fusion and c.fp8 is None
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size) == (2, 2)
    assert c.attention_backend.name == "local"


def test_padded_vocab():
    assert padded_vocab_size(100, 1) == 128 and padded_vocab_size(100, 2) == 256
    assert padded_vocab_size(151936, 1) == 151936 and padded_vocab_size(151936, 8) == 152576


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_configuration_fields(fmt, recipe):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = transformer_config_kwargs(CFG, use_cpu=False, use_te=True, params_dtype=torch.bfloat16, fp8=fmt,
                                   fp8_recipe=recipe, fp8_param=True)
    assert kw["fp8"] == fmt and kw["fp8_recipe"] == recipe and kw["fp8_param"] and kw["bf16"]
    assert kw["attention_backend"].name == "auto" and kw["apply_rope_fusion"]
    if recipe == "delayed":
        assert kw["fp8_amax_history_len"] == 1024 and kw["fp8_amax_compute_algo"] == "max"
    # megatron accepts the fields (RoPE fusion needs TE itself, so it is switched off for this check)
    c = TransformerConfig(**{**kw, "apply_rope_fusion": False})
    assert (c.fp8, c.fp8_recipe, c.fp8_param) == (fmt, recipe, True)


def test_fp8_kwargs_validation():
    assert fp8_kwargs(None) == {}
    with pytest.raises(ValueError, match="fp8='e5m2' is not one of"):
        fp8_kwargs("e5m2")
    with pytest.raises(ValueError, match="fp8_recipe='nvfp4' is not one of"):
        fp8_kwargs("e4m3", "nvfp4")
    with pytest.raises(ValueError, match="fp8_param=True needs fp8"):
        fp8_kwargs(None, fp8_param=True)
    with pytest.raises(ValueError, match="needs the Transformer Engine layer spec"):
        transformer_config_kwargs(CFG, use_cpu=False, use_te=False, fp8="e4m3")


@cpu_only
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
def test_fp8_without_gpu_is_a_clear_error(recipe):
    with pytest.raises(ValueError, match=f"fp8='hybrid' with fp8_recipe='{recipe}' cannot run on this machine: "
                                         "FP8 needs a CUDA GPU"):
        transformer_config(CFG, use_cpu=False, fp8="hybrid", fp8_recipe=recipe)
    with pytest.raises(ValueError, match="use_te=True needs Transformer Engine importable and a CUDA GPU"):
        transformer_config(CFG, use_cpu=False, use_te=True)
    with pytest.raises(ValueError, match="use_te=True needs"):
        layer_spec(use_te=True)


@cpu_only
def test_auto_spec_on_cpu_is_local():
    from megatron.core.transformer.identity_op import IdentityOp

    assert not capability.te_available()
    spec = layer_spec()  # use_te=None: decided here, at call time
    assert spec.submodules.input_layernorm is not IdentityOp  # local spec keeps its own norms
    c = transformer_config(CFG, use_cpu=False)  # no TE on this machine: the local path even off-CPU
    assert c.attention_backend.name == "local" and not c.apply_rope_fusion


def test_fp8_capability_asks_transformer_engine(monkeypatch):
    """With a GPU and TE present, the answer is TE's own check for the recipe's scaling mode."""
    import megatron.core.utils as mutils

    asked = []
    fp8_mod = types.ModuleType("transformer_engine.pytorch.fp8")
    fp8_mod.check_fp8_support = lambda: (asked.append("fp8") or (True, ""))
    fp8_mod.check_mxfp8_support = lambda: (asked.append("mxfp8") or (False, "MXFP8 needs Blackwell"))
    fp8_mod.check_fp8_block_scaling_support = lambda: (asked.append("block") or (True, ""))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", None)  # older TE layout
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.fp8", fp8_mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(capability, "te_importable", lambda: True)
    monkeypatch.setattr(mutils, "is_te_min_version", lambda v, *a, **k: True)
    assert capability.fp8_support("delayed") == (True, "")
    assert capability.fp8_support("blockwise") == (True, "")
    assert capability.fp8_support("mxfp8") == (False, "MXFP8 needs Blackwell")
    assert asked == ["fp8", "block", "mxfp8"]
    with pytest.raises(ValueError, match="MXFP8 needs Blackwell"):
        capability.require_fp8("e4m3", "mxfp8")
    monkeypatch.setattr(mutils, "is_te_min_version", lambda v, *a, **k: v < "2.2")
    assert capability.fp8_support("tensorwise") == (False, "FP8 recipe 'tensorwise' needs Transformer Engine >= 2.2.0.dev0")


def test_packed_seq_params_thd():
    p = packed_seq_params([3, 5, 2])
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q.tolist() == [0, 3, 8, 10]
    assert p.cu_seqlens_kv.tolist() == [0, 3, 8, 10] and p.max_seqlen_q == p.max_seqlen_kv == 5
    assert p.cu_seqlens_q_padded is None
    q = packed_seq_params(torch.tensor([3, 5, 2]), pad_to_multiple_of=4)
    assert q.cu_seqlens_q.tolist() == [0, 3, 8, 10]  # real lengths
    assert q.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16] and q.max_seqlen_q == 8
    for bad in ([], [3, 0]):
        with pytest.raises(ValueError, match="must be positive"):
            packed_seq_params(bad)


# ---------------------------------------------------------------------------------------------
# presets: numbers of the released config.json files; parameter counts of the model cards

CARDS = {  # name -> (total, without embeddings) in billions, from the Qwen3 model cards
    "qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
}


MOE_FIELDS = {"num_experts", "moe_ffn_hidden_size", "moe_router_topk", "norm_topk_prob", "router_aux_loss_coef"}


@pytest.mark.parametrize("preset", sorted(CARDS))
def test_presets(preset):
    path = os.path.join(REPO, "configs", "model", preset + ".yaml")
    with open(path) as f:
        text = f.read()
    assert text.startswith("# @package model")
    values = yaml.safe_load(text)
    # every field, except the mixture-of-experts ones a dense preset leaves at their defaults
    assert set(values) == {f.name for f in dataclasses.fields(ModelConfig)} - MOE_FIELDS
    m = ModelConfig(**values)
    assert (m.vocab_size, m.head_dim, m.num_query_groups, m.rope_theta, m.rms_norm_eps) == (151936, 128, 8, 1e6, 1e-6)
    assert m.max_position_embeddings == 40960 and m.tokenizer == "qwen3"
    assert m.tie_word_embeddings == (preset in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))
    total = sum(math.prod(s) for s in hf_shapes(m).values()) / 1e9
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) / 1e9
    card_total, card_body = CARDS[preset]
    assert abs(total - embed - card_body) / card_body < 0.01
    assert abs(total - card_total) / card_total < 0.03


def test_every_qwen3_preset_is_checked():
    found = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "configs", "model", "qwen3-*.yaml"))
             if yaml.safe_load(open(p))["family"] == "qwen3"}  # the qwen3_moe presets: test_models_qwen3_moe.py
    assert found == set(CARDS)
