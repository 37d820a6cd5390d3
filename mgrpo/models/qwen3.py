"""Qwen3 (dense) as a model family: its Megatron configuration, HF <-> Megatron names, HF config, size.

Qwen3 is a GPT with RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, RMSNorm on queries
and keys (qk_layernorm), no biases, and a head_dim independent of hidden_size / num_heads. Nothing
here imports torch, megatron or transformers at module level (the planner counts parameters without
them); the functions that need them import them when called.

Megatron (one pipeline stage, layer j = local index, i = global index = layer_number - 1):

  embedding.word_embeddings.weight            <- model.embed_tokens.weight    rows split by TP, vocab padded
  decoder.layers.j.input_layernorm.weight     <- model.layers.i.input_layernorm.weight
      (TE spec: decoder.layers.j.self_attention.linear_qkv.layer_norm_weight)
  decoder.layers.j.self_attention.linear_qkv.weight <- q_proj, k_proj, v_proj fused per query group:
      for each group g: its heads/groups query heads, then k head g, then v head g; TP splits groups
  decoder.layers.j.self_attention.q_layernorm.weight <- model.layers.i.self_attn.q_norm.weight
  decoder.layers.j.self_attention.k_layernorm.weight <- model.layers.i.self_attn.k_norm.weight
  decoder.layers.j.self_attention.linear_proj.weight <- o_proj            columns split by TP
  decoder.layers.j.pre_mlp_layernorm.weight   <- model.layers.i.post_attention_layernorm.weight
      (TE spec: decoder.layers.j.mlp.linear_fc1.layer_norm_weight)
  decoder.layers.j.mlp.linear_fc1.weight      <- gate_proj, up_proj: each TP shard holds
                                                 [its gate rows; its up rows]
  decoder.layers.j.mlp.linear_fc2.weight      <- down_proj               columns split by TP
  decoder.final_layernorm.weight              <- model.norm.weight
  output_layer.weight                         <- lm_head.weight (untied), rows split by TP, vocab padded;
      tied with PP>1: the last stage's copy of model.embed_tokens.weight (loaded, never exported);
      tied with PP=1: absent (the output layer uses the embedding).
"""

from __future__ import annotations

from typing import Optional, Sequence

from mgrpo.models.family import ModelFamily, hf_rope
from mgrpo.models.shapes import FC1, QKV, REPLICATED, ROW_PARALLEL, VOCAB, LayerParams, Weight

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
QWEN3_VOCAB = 151936
"""Vocabulary size of the released Qwen3 checkpoints (the packaged 'qwen3' tokenizer's)."""


# --- Megatron --------------------------------------------------------------------------------------
def megatron_config(model) -> dict:
    import torch

    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
    )


def megatron_layer_spec(use_te: bool, model=None):
    """The TE spec fuses the pre-attention and pre-MLP RMSNorms into `linear_qkv` / `linear_fc1`
    (`layer_norm_weight`); the local spec keeps them as `input_layernorm` / `pre_mlp_layernorm`.
    `stage_weights` handles both key sets."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


def megatron_model(model) -> dict:
    return dict(position_embedding_type="rope", rotary_base=int(model.rope_theta))


# --- HF <-> Megatron names -------------------------------------------------------------------------
def hf_layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return dict(input_norm=p + "input_layernorm.weight", q=p + "self_attn.q_proj.weight",
                k=p + "self_attn.k_proj.weight", v=p + "self_attn.v_proj.weight",
                q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight",
                o=p + "self_attn.o_proj.weight", post_norm=p + "post_attention_layernorm.weight",
                gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight", down=p + "mlp.down_proj.weight")


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF Qwen3ForCausalLM checkpoint with its shape, in HF order."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    out = {EMBED: (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        n = hf_layer_names(i)
        out.update({n["input_norm"]: (h,), n["q"]: (q_rows, h), n["k"]: (kv_rows, h), n["v"]: (kv_rows, h),
                    n["q_norm"]: (hd,), n["k_norm"]: (hd,), n["o"]: (h, q_rows), n["post_norm"]: (h,),
                    n["gate"]: (f, h), n["up"]: (f, h), n["down"]: (h, f)})
    out[FINAL_NORM] = (h,)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (cfg.vocab_size, h)
    return out


def _pick(param_names: Optional[set[str]], *candidates: str) -> str:
    """The first candidate the stage actually has (local vs TE spec key); the first if none."""
    if param_names is not None:
        for c in candidates:
            if c in param_names:
                return c
    return candidates[0]


def stage_weights(cfg, *, layers: Sequence[int], pre_process: bool, post_process: bool,
                  param_names: Optional[set[str]] = None) -> list[Weight]:
    """The weights of one pipeline stage in export order (layers = global index of each local layer)."""
    out: list[Weight] = []
    if pre_process:
        out.append(Weight("embedding.word_embeddings.weight", (EMBED,), VOCAB))
    for j, i in enumerate(layers):
        m, n = f"decoder.layers.{j}.", hf_layer_names(i)
        out += [
            Weight(_pick(param_names, m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight"),
                   (n["input_norm"],), REPLICATED),
            Weight(m + "self_attention.linear_qkv.weight", (n["q"], n["k"], n["v"]), QKV),
            Weight(m + "self_attention.q_layernorm.weight", (n["q_norm"],), REPLICATED),
            Weight(m + "self_attention.k_layernorm.weight", (n["k_norm"],), REPLICATED),
            Weight(m + "self_attention.linear_proj.weight", (n["o"],), ROW_PARALLEL),
            Weight(_pick(param_names, m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"),
                   (n["post_norm"],), REPLICATED),
            Weight(m + "mlp.linear_fc1.weight", (n["gate"], n["up"]), FC1),
            Weight(m + "mlp.linear_fc2.weight", (n["down"],), ROW_PARALLEL),
        ]
    if post_process:
        out.append(Weight("decoder.final_layernorm.weight", (FINAL_NORM,), REPLICATED))
        if not cfg.tie_word_embeddings:
            out.append(Weight("output_layer.weight", (LM_HEAD,), VOCAB))
        elif not pre_process:
            out.append(Weight("output_layer.weight", (EMBED,), VOCAB, export=False))
    return out


# --- HF config -------------------------------------------------------------------------------------
def hf_config_fields(model, dtype: str) -> dict:
    """The config.json fields every Qwen3 (dense or MoE) takes from `model` (`dtype`: the weights' dtype)."""
    import transformers

    # transformers 5 names the weights' dtype `dtype`; 4.x named it `torch_dtype`.
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.rms_norm_eps,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.init_std,
        hidden_act="silu",
        attention_bias=False,
        **{dtype_key: dtype},
    )


def hf_config(model, *, dtype: str = "float32", **extra):
    """The transformers `Qwen3Config` describing the same architecture (`dtype`: the weights' dtype)."""
    from transformers import Qwen3Config

    return Qwen3Config(**hf_config_fields(model, dtype), **extra)


def hf_parse_config(raw: dict):
    from transformers import Qwen3Config

    return Qwen3Config.from_dict(raw)


def hf_model(config):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(config)


def hf_unsupported(cfg, path: str) -> list[str]:
    """Qwen3 variants this family does not implement, each named."""
    errors = []
    _, rope = hf_rope(cfg)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        errors.append(f"{path} rope type {rope.get('rope_type', rope.get('type'))!r} (rope scaling) is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        errors.append(f"{path} hidden_act={cfg.hidden_act!r}, only 'silu' is supported")
    if getattr(cfg, "attention_bias", False):
        errors.append(f"{path} attention_bias=true is not supported (Qwen3 has no biases)")
    if getattr(cfg, "use_sliding_window", False):
        errors.append(f"{path} use_sliding_window=true is not supported")
    return errors


# config.json field -> ModelConfig field, compared by check_hf_config.
HF_CHECKED_FIELDS = (
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("intermediate_size", "ffn_hidden_size"),
    ("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_query_groups"), ("head_dim", "head_dim"), ("rope_theta", "rope_theta"),
    ("rms_norm_eps", "rms_norm_eps"), ("tie_word_embeddings", "tie_word_embeddings"),
    ("max_position_embeddings", "max_position_embeddings"),
)


def hf_json_fields(raw: dict) -> dict:
    """The ModelConfig architecture fields of a Qwen3 config.json (a plain dict: no torch), with
    transformers' defaults for the fields a config.json may leave out. The one mapping of this family:
    `hf_model_fields` reads a parsed transformers config through it."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [hf for hf in required if raw.get(hf) is None]
    if missing:  # transformers' defaults for these describe another model (Qwen3Config(): 4096 hidden, 32 layers)
        raise ValueError(f"config.json has no {', '.join(missing)} (a {raw.get('model_type', 'qwen3')} config.json "
                         f"names {', '.join(required)})")
    fields = {ours: raw[hf] for hf, ours in HF_CHECKED_FIELDS if hf in required}
    rope = raw.get("rope_parameters") or {}
    fields.update(
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        num_query_groups=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 1_000_000.0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        init_std=raw.get("initializer_range", 0.02),
    )
    return fields


def hf_model_fields(cfg) -> dict:
    """The ModelConfig architecture fields of a transformers Qwen3Config."""
    return hf_json_fields(cfg.to_dict())


def default_tokenizer(vocab_size: int) -> str:
    """A checkpoint without tokenizer files of the real Qwen3 vocabulary size uses the packaged Qwen3 tokenizer."""
    return "qwen3" if vocab_size == QWEN3_VOCAB else "synthetic"


def config_errors(model) -> list[str]:
    """What the dense family cannot build from a ModelConfig."""
    if model.num_experts:
        return [f"model.num_experts={model.num_experts} but model.family={model.family!r} is dense "
                "(mixture-of-experts Qwen3 is model.family=qwen3_moe)"]
    return []


# --- size ------------------------------------------------------------------------------------------
def layer_params(m) -> LayerParams:
    """Parameters of one Qwen3 decoder layer (no biases), by part."""
    h, hd, nq, nkv, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    return LayerParams(
        sharded={
            "qkv": h * (nq + 2 * nkv) * hd,  # fused Q, K, V projections (GQA: nkv key/value heads)
            "proj": nq * hd * h,             # attention output
            "fc1": h * 2 * f,                # SwiGLU gate and up, fused
            "fc2": f * h,                    # SwiGLU down
        },
        replicated={"norms": 2 * h + 2 * hd},  # input and pre-MLP RMSNorm, q_norm and k_norm over head_dim
    )


QWEN3 = ModelFamily(
    name="qwen3",
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    megatron_config=megatron_config,
    megatron_layer_spec=megatron_layer_spec,
    megatron_model=megatron_model,
    hf_shapes=hf_shapes,
    stage_weights=stage_weights,
    hf_config=hf_config,
    hf_parse_config=hf_parse_config,
    hf_model=hf_model,
    hf_unsupported=hf_unsupported,
    hf_model_fields=hf_model_fields,
    hf_json_fields=hf_json_fields,
    hf_checked_fields=HF_CHECKED_FIELDS,
    layer_params=layer_params,
    default_tokenizer=default_tokenizer,
    config_errors=config_errors,
)
