"""Qwen3-MoE (Hugging Face `Qwen3MoeForCausalLM`) as a model family.

Qwen3's attention (qwen3.py) with every MLP replaced by a mixture of experts: a router (a bias-free
[experts, hidden] linear) picks `num_experts_per_tok` of `num_experts` SwiGLU experts per token; no
shared expert. Qwen3's router (transformers' Qwen3MoeTopKRouter) takes a softmax over all logits, the
top k of it, and with `norm_topk_prob` divides them by their sum. Megatron's TopKRouter
(moe_utils.topk_routing_with_score_function, score_function='softmax') gives the same weights:
  - norm_topk_prob=True:  softmax(all)[topk] / sum = softmax(logits[topk]), megatron's
    moe_router_pre_softmax=False (top k of the logits, then a softmax over them; softmax is monotone,
    so the same experts win);
  - norm_topk_prob=False: megatron's moe_router_pre_softmax=True (softmax over all, then its top k).
Megatron refuses top-1 without pre-softmax (a softmax over one logit has no gradient); transformers'
norm_topk_prob=True at top-1 weights every token 1.0, so that combination is refused here by name.
The router runs in fp32 (moe_router_dtype='fp32'); the load-balancing loss is megatron's 'aux_loss'
with the checkpoint's router_aux_loss_coef.

Megatron (one pipeline stage, layer j local, i global, l = local expert, e = ep_rank * E/ep + l global):

  attention, input_layernorm, final norm, embeddings, output layer   as in qwen3.py
  decoder.layers.j.pre_mlp_layernorm.weight           <- model.layers.i.post_attention_layernorm.weight
  decoder.layers.j.mlp.router.weight                  <- model.layers.i.mlp.gate.weight       [E, H]
  decoder.layers.j.mlp.experts.local_experts.l.linear_fc1.weight
                        <- model.layers.i.mlp.experts.e.gate_proj.weight, ...up_proj.weight   [2I, H]
  decoder.layers.j.mlp.experts.local_experts.l.linear_fc2.weight
                        <- model.layers.i.mlp.experts.e.down_proj.weight                      [H, I]
      (TE spec with grouped GEMM: decoder.layers.j.mlp.experts.linear_fc1.weight{l} / linear_fc2.weight{l})

Checkpoints name every expert (transformers 4.x keeps them as modules under those names; 5.x fuses
them in memory into experts.gate_up_proj [E, 2I, H] = [gate; up] per expert and experts.down_proj
[E, H, I], and writes them back per expert): `hf_named_tensors` maps either to the checkpoint names.
Experts are never split by tensor parallelism here (expert tensor parallel size 1).

Refused by name: shared experts, dense MLP layers between MoE layers (`mlp_only_layers`,
`decoder_sparse_step != 1`), and everything qwen3.py refuses.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mgrpo.models import qwen3
from mgrpo.models.family import ModelFamily
from mgrpo.models.shapes import EXPERT_FC1, EXPERT_FC2, ROUTER, LayerParams, Weight

_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


# --- Megatron --------------------------------------------------------------------------------------
def megatron_config(model) -> dict:
    out = qwen3.megatron_config(model)
    out.update(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model.router_aux_loss_coef,
    )
    return out


def megatron_layer_spec(use_te: bool, model=None):
    """The MoE layer spec: megatron's SequentialMLP experts on the local spec, Transformer Engine's
    grouped GEMM with TE (the pre-MLP RMSNorm stays a module of its own in both: MoE does not fuse it)."""
    num_experts = model.num_experts if model is not None else None
    if not num_experts:
        raise ValueError("the qwen3_moe layer spec needs model.num_experts > 0")
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=True,
                                                          qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")


# --- HF <-> Megatron names -------------------------------------------------------------------------
def hf_router_name(i: int) -> str:
    return f"model.layers.{i}.mlp.gate.weight"


def hf_expert_names(i: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) of expert e in layer i, as checkpoints and SGLang's Qwen3-MoE loader name them."""
    p = f"model.layers.{i}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF Qwen3MoeForCausalLM checkpoint with its shape."""
    h, i_moe, n = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts
    out = {}
    for name, shape in qwen3.hf_shapes(cfg).items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            continue
        if name.endswith("mlp.down_proj.weight"):  # where the dense MLP was: the router and the experts
            i = int(name.split(".")[2])
            out[hf_router_name(i)] = (n, h)
            for e in range(n):
                gate, up, down = hf_expert_names(i, e)
                out.update({gate: (i_moe, h), up: (i_moe, h), down: (h, i_moe)})
            continue
        out[name] = shape
    return out


def stage_weights(cfg, *, layers: Sequence[int], pre_process: bool, post_process: bool,
                  param_names: Optional[set[str]] = None, experts: Optional[Sequence[int]] = None) -> list[Weight]:
    """The weights of one pipeline stage in export order; `experts` are the global indices of this rank's
    local experts (None: all, as at expert-parallel size 1)."""
    experts = list(range(cfg.num_experts)) if experts is None else list(experts)
    grouped = param_names is not None and any(".mlp.experts.linear_fc1.weight" in p for p in param_names)
    dense = qwen3.stage_weights(cfg, layers=layers, pre_process=pre_process, post_process=post_process,
                                param_names=param_names)
    out: list[Weight] = []
    for w in dense:
        if not w.megatron.endswith(_DENSE_MLP):
            out.append(w)
        elif w.megatron.endswith("mlp.linear_fc1.weight"):  # one per layer: the MoE block takes its place
            prefix = w.megatron[: -len("mlp.linear_fc1.weight")]
            i = layers[int(prefix.split(".")[2])]
            out.append(Weight(prefix + "mlp.router.weight", (hf_router_name(i),), ROUTER))
            for l, e in enumerate(experts):
                gate, up, down = hf_expert_names(i, e)
                fc1, fc2 = ((f"{prefix}mlp.experts.linear_fc1.weight{l}", f"{prefix}mlp.experts.linear_fc2.weight{l}")
                            if grouped else (f"{prefix}mlp.experts.local_experts.{l}.linear_fc1.weight",
                                             f"{prefix}mlp.experts.local_experts.{l}.linear_fc2.weight"))
                out += [Weight(fc1, (gate, up), EXPERT_FC1), Weight(fc2, (down,), EXPERT_FC2)]
    return out


# --- HF config -------------------------------------------------------------------------------------
def hf_config(model, *, dtype: str = "float32", **extra):
    """The transformers `Qwen3MoeConfig` of the same architecture (every layer sparse, no dense MLP)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **qwen3.hf_config_fields(model, dtype),
        moe_intermediate_size=model.moe_ffn_hidden_size,
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        norm_topk_prob=model.norm_topk_prob,
        router_aux_loss_coef=model.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **extra,
    )


def hf_parse_config(raw: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig.from_dict(raw)


def hf_model(config):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(config)


def hf_unsupported(cfg, path: str) -> list[str]:
    """Qwen3-MoE variants this family does not implement, each named."""
    errors = qwen3.hf_unsupported(cfg, path)
    if getattr(cfg, "mlp_only_layers", None):
        errors.append(f"{path} mlp_only_layers={list(cfg.mlp_only_layers)}: dense MLP layers among the MoE layers "
                      "are not supported")
    if getattr(cfg, "decoder_sparse_step", 1) != 1:
        errors.append(f"{path} decoder_sparse_step={cfg.decoder_sparse_step}: only every layer sparse (1) is "
                      "supported")
    shared = getattr(cfg, "shared_expert_intermediate_size", None) or getattr(cfg, "num_shared_experts", None)
    if shared:
        errors.append(f"{path} has shared experts (shared_expert_intermediate_size / num_shared_experts="
                      f"{shared}), which Qwen3-MoE does not have and this family does not support")
    if not getattr(cfg, "num_experts", 0):
        errors.append(f"{path} num_experts={getattr(cfg, 'num_experts', None)}: a Qwen3-MoE checkpoint needs experts")
    return errors


# config.json field -> ModelConfig field, compared by check_hf_config (router_aux_loss_coef is a training
# setting, not the architecture: model.router_aux_loss_coef may differ from the checkpoint's).
HF_CHECKED_FIELDS = tuple(qwen3.HF_CHECKED_FIELDS) + (
    ("num_experts", "num_experts"), ("moe_intermediate_size", "moe_ffn_hidden_size"),
    ("num_experts_per_tok", "moe_router_topk"), ("norm_topk_prob", "norm_topk_prob"),
)


def hf_json_fields(raw: dict) -> dict:
    """The ModelConfig architecture fields of a Qwen3-MoE config.json (a plain dict: no torch), with
    transformers' defaults for what it leaves out. transformers 5 writes the expert count as
    `num_local_experts` (its attribute map for `num_experts`), 4.x as `num_experts`."""
    fields = qwen3.hf_json_fields(raw)
    fields.update(num_experts=int(raw.get("num_experts", raw.get("num_local_experts")) or 0),
                  moe_ffn_hidden_size=int(raw.get("moe_intermediate_size", 768)),
                  moe_router_topk=int(raw.get("num_experts_per_tok", 8)),
                  norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                  router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)))
    return fields


def hf_model_fields(cfg) -> dict:
    """The ModelConfig architecture fields of a transformers Qwen3MoeConfig (through `hf_json_fields`)."""
    return hf_json_fields(cfg.to_dict())


def hf_named_tensors(model) -> dict:
    """A transformers Qwen3MoeForCausalLM's weights under checkpoint names, sharing its memory: 5.x's
    fused experts.gate_up_proj / down_proj as per-expert views, 4.x's expert modules as they are."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            i = int(name.split(".")[2])
            data = p.detach()
            for e in range(data.shape[0]):
                gate, up, down = hf_expert_names(i, e)
                if name.endswith("gate_up_proj"):
                    half = data.shape[1] // 2
                    out[gate], out[up] = data[e, :half], data[e, half:]
                else:
                    out[down] = data[e]
        else:
            out[name] = p
    return out


def config_errors(model) -> list[str]:
    """What this family cannot build from a ModelConfig, each naming the field."""
    e = []
    if model.num_experts < 1:
        e.append(f"model.num_experts={model.num_experts} must be at least 1 for model.family=qwen3_moe")
    if model.moe_ffn_hidden_size < 1:
        e.append(f"model.moe_ffn_hidden_size={model.moe_ffn_hidden_size} must be positive for model.family=qwen3_moe")
    if not 1 <= model.moe_router_topk <= max(model.num_experts, 1):
        e.append(f"model.moe_router_topk={model.moe_router_topk} must be in 1..model.num_experts={model.num_experts}")
    elif model.moe_router_topk == 1 and model.norm_topk_prob:
        e.append("model.moe_router_topk=1 with model.norm_topk_prob=true weights every token 1.0, which megatron-core "
                 "refuses (a softmax over one logit has no gradient); use model.norm_topk_prob=false")
    if model.router_aux_loss_coef < 0:
        e.append(f"model.router_aux_loss_coef={model.router_aux_loss_coef} must be non-negative")
    return e


# --- size ------------------------------------------------------------------------------------------
def layer_params(m) -> LayerParams:
    """Parameters of one Qwen3-MoE decoder layer: attention split by TP, norms and the router whole,
    the routed experts split by EP."""
    dense = qwen3.layer_params(m)
    sharded = {k: v for k, v in dense.sharded.items() if k not in ("fc1", "fc2")}
    h, i_moe, n = m.hidden_size, m.moe_ffn_hidden_size, m.num_experts
    return LayerParams(
        sharded=sharded,
        replicated={**dense.replicated, "router": n * h},
        expert={"experts_fc1": n * h * 2 * i_moe, "experts_fc2": n * i_moe * h},
    )


QWEN3_MOE = ModelFamily(
    name="qwen3_moe",
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    megatron_config=megatron_config,
    megatron_layer_spec=megatron_layer_spec,
    megatron_model=qwen3.megatron_model,
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
    default_tokenizer=qwen3.default_tokenizer,
    config_errors=config_errors,
    hf_named_tensors=hf_named_tensors,
    has_experts=True,
)
