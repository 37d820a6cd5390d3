"""Any model family as a Megatron-Core GPTModel: TransformerConfig, layer spec and one pipeline stage.

The family (`model.family`, see family.py) gives the architecture; this module adds what every run
shares: the parallel layout, the dtype, no dropout, and the backend (megatron's local modules on CPU,
Transformer Engine with optional FP8 on GPU). It holds no process groups (they come in through
`pg_collection`) and no training logic.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from mgrpo.config import ModelConfig
from mgrpo.models.capability import FP8_FORMATS, FP8_RECIPES, require_fp8, resolve_use_te, te_available
from mgrpo.models.registry import family_of
from mgrpo.models.shapes import padded_vocab_size


def fp8_kwargs(fp8: Optional[str], fp8_recipe: str = "delayed", *, fp8_param: bool = False) -> dict:
    """TransformerConfig fields for FP8 through Transformer Engine (empty when fp8 is None).

    `fp8` is the format (`e4m3`: e4m3 everywhere; `hybrid`: e4m3 forward, e5m2 for gradients) and
    `fp8_recipe` the scaling recipe, both spelled as megatron's TransformerConfig spells them.
    Delayed scaling keeps an amax history; the others scale from the current tensor (tensorwise),
    per 128x128 / 1x128 block (blockwise) or per 32-element micro-block (mxfp8).
    """
    if fp8 is None:
        if fp8_param:
            raise ValueError("fp8_param=True needs fp8 set to 'e4m3' or 'hybrid'")
        return {}
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r} is not one of {list(FP8_FORMATS)}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={fp8_recipe!r} is not one of {list(FP8_RECIPES)}")
    kwargs = dict(fp8=fp8, fp8_recipe=fp8_recipe, fp8_param=fp8_param, fp8_wgrad=True)
    if fp8_recipe == "delayed":
        # TE's own DelayedScaling defaults (megatron's are a 1-step history, which is noisier).
        kwargs.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max", fp8_margin=0)
    return kwargs


def transformer_config_kwargs(model: ModelConfig, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                              use_cpu: bool, use_te: bool = False, params_dtype: torch.dtype = torch.float32,
                              sequence_parallel: bool = False, fp8: Optional[str] = None,
                              fp8_recipe: str = "delayed", fp8_param: bool = False,
                              cp_comm_type: str = "p2p", recompute: Optional[str] = None,
                              routing_replay: bool = False) -> dict:
    """The TransformerConfig fields for `model` (its family's architecture) at a parallel layout,
    without any capability check. Kept separate from `transformer_config` so the GPU configuration
    can be inspected on a CPU.

    A mixture-of-experts family runs its experts `ep` ways (expert tensor parallelism 1) and, with
    tp > 1, sequence parallel: megatron's MoE layer refuses TP without it in training, and with every TP
    rank dispatching the same tokens each expert would see them tp times (gradients tp x too large).
    `routing_replay` builds megatron's RouterReplay in every router (training/router_replay.py drives it).
    """
    from megatron.core.transformer.enums import AttnBackend

    if fp8 is not None and not use_te:
        raise ValueError(f"fp8={fp8!r} needs the Transformer Engine layer spec (use_te=True)")
    kwargs = dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        # RL micro-batches are packed under a token budget, so their shapes differ: pipeline stages
        # exchange shapes before activations. (megatron rejects this flag with its default MoE
        # dispatcher 'allgather' even for dense models; 'alltoall' is inert without experts.)
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=False,
    )
    kwargs.update(family_of(model).megatron_config(model))
    if kwargs.get("num_moe_experts"):
        kwargs.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                      sequence_parallel=tp > 1, moe_grouped_gemm=use_te and not use_cpu,
                      moe_enable_routing_replay=routing_replay)
    elif ep != 1:
        raise ValueError(f"expert parallelism (ep={ep}) needs a mixture-of-experts model; model.family="
                         f"{model.family!r} has no experts")
    if recompute == "full":  # every layer's activations recomputed in backward, one layer per checkpoint
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":  # core attention only
        kwargs.update(recompute_granularity="selective")
    if use_cpu:
        kwargs.update(
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            # megatron's SwiGLU autograd function (fusions/fused_bias_swiglu.py), as on a GPU: it keeps only its
            # input for backward, where the unfused glu also keeps silu's output ([tokens x ffn] per layer); its
            # backward on CPU is cpu_compat's swiglu_back, autograd's own ops, so the gradients are the same bits
            bias_activation_fusion=True,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            cross_entropy_loss_fusion=False,
            attention_backend=AttnBackend.local,
        )
    elif use_te:
        # TE picks flash / cuDNN fused attention (both take THD-packed sequences); RoPE and
        # SwiGLU fusions are TE kernels too.
        kwargs.update(attention_backend=AttnBackend.auto, bias_activation_fusion=True, apply_rope_fusion=True)
        if cp > 1:  # TE's exchange of keys and values between CP ranks (the CPU reference all-gathers)
            kwargs.update(cp_comm_type=cp_comm_type)
    else:
        # Local spec on a GPU without TE: megatron's own fused kernels only (RoPE fusion needs TE).
        kwargs.update(attention_backend=AttnBackend.local, bias_activation_fusion=True, apply_rope_fusion=False)
    kwargs.update(fp8_kwargs(fp8, fp8_recipe, fp8_param=fp8_param))
    return kwargs


def transformer_config(model: ModelConfig, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, use_cpu: bool,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       fp8: Optional[str] = None, fp8_recipe: str = "delayed", fp8_param: bool = False,
                       use_te: Optional[bool] = None, cp_comm_type: str = "p2p", recompute: Optional[str] = None,
                       routing_replay: bool = False):
    """TransformerConfig for `model` at the given parallel layout.

    On CPU the fused CUDA kernels (softmax, bias-dropout, RoPE, grad-accumulation fusion) are off and
    weights are initialised on the CPU, which also makes the initial weights independent of TP size.
    `use_te=None` picks the Transformer Engine path when it can run here (TE importable, CUDA present,
    not `use_cpu`); asking for TE or FP8 where it cannot run is a ValueError naming what is missing.
    Pass the same `use_te` to `build_gpt_model`.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if fp8 is not None:
        require_fp8(fp8, fp8_recipe)  # names what is missing: a GPU, TE, a TE version, the GPU generation
    if use_cpu and use_te:
        raise ValueError("use_cpu=True runs the local layer spec; use_te=True needs a GPU")
    use_te = resolve_use_te(use_te, use_cpu=use_cpu)
    if fp8 is not None and not use_te:
        raise ValueError(f"fp8={fp8!r} needs the Transformer Engine layer spec, but use_te=False")
    kwargs = transformer_config_kwargs(model, tp=tp, pp=pp, cp=cp, ep=ep, use_cpu=use_cpu, use_te=use_te,
                                       params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                       fp8=fp8, fp8_recipe=fp8_recipe, fp8_param=fp8_param,
                                       cp_comm_type=cp_comm_type, recompute=recompute,
                                       routing_replay=routing_replay)
    return TransformerConfig(**kwargs)


class SequenceParallelTorchNorm:
    """megatron's WrappedTorchNorm (the local spec's RMSNorm) under sequence parallelism.

    WrappedTorchNorm refuses `sequence_parallel`, but a norm needs nothing from it: it is built from a
    copy of the config without the flag and its weight is marked `sequence_parallel`, as Transformer
    Engine's norms mark theirs, so that finalize_model_grads sums its gradient over the TP ranks (each
    of which saw 1/tp of the tokens). The q/k norms, which see whole sequences but 1/tp of the heads,
    are summed over TP for that reason as well (megatron does it by name for qk_layernorm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def with_sequence_parallel_norms(spec, tf_config, pp_rank: int, vp_stage=None):
    """A local decoder-layer spec whose RMSNorms take sequence parallelism (`SequenceParallelTorchNorm`),
    as the block spec of one pipeline stage (its final norm too, which megatron would otherwise take
    from its module-level default, the torch norm)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    for owner, name in ((sub, "input_layernorm"), (sub, "pre_mlp_layernorm"),
                        (sub.self_attention.submodules, "q_layernorm"), (sub.self_attention.submodules, "k_layernorm")):
        if getattr(owner, name) is WrappedTorchNorm:
            setattr(owner, name, SequenceParallelTorchNorm)
    n = get_num_layers_to_build(tf_config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=SequenceParallelTorchNorm)


def with_reference_attention(spec):
    """A copy of a local decoder-layer spec whose core attention is `ReferenceCoreAttention`: exact
    attention over THD-packed and context-parallel batches, which megatron's local
    `DotProductAttention` refuses (see mgrpo/models/attention.py)."""
    import copy

    from mgrpo.models.attention import ReferenceCoreAttention

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ReferenceCoreAttention
    return spec


def build_gpt_model(model: ModelConfig, tf_config, *, pre_process: bool, post_process: bool,
                    pg_collection=None, use_te: Optional[bool] = None, vocab_padded: Optional[int] = None,
                    packed: bool = False):
    """One pipeline stage of `model` as a GPTModel.

    `use_te=None` follows the config: the TE spec exactly when `tf_config` was built for it
    (fp8 set or a non-local attention backend) and TE can run here. `packed`: the stage will be fed
    THD-packed micro-batches. TE's attention takes those and context parallelism itself; without TE
    (the local spec) every batch goes through `ReferenceCoreAttention` instead of megatron's local
    attention, which refuses packed and CP batches and, on padded ones, materialises the s x s scores
    and GQA-expanded keys and values that torch's fused attention does not (same values within 5e-7,
    2.5x faster forward+backward on the default job's batch).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.enums import AttnBackend

    if use_te is None:
        use_te = (tf_config.fp8 is not None or tf_config.attention_backend != AttnBackend.local) and te_available()
    family = family_of(model)
    tp = tf_config.tensor_model_parallel_size
    spec = family.layer_spec(use_te=use_te, model=model)
    if not use_te:
        spec = with_reference_attention(spec)
        if tf_config.sequence_parallel:
            pp_rank = pg_collection.pp.rank() if pg_collection is not None else 0
            spec = with_sequence_parallel_norms(spec, tf_config, pp_rank)
    return GPTModel(
        config=tf_config,
        transformer_layer_spec=spec,
        vocab_size=vocab_padded or padded_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        pg_collection=pg_collection,
        **family.megatron_model(model),
    )


def stage_padding_mask(model, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The padding mask [b, s] (True = padding) as one pipeline stage of a mixture-of-experts GPTModel
    takes it, None for a dense model (which ignores it). GPTModel splits it over the sequence-parallel
    ranks on the first stage only, where it embeds the tokens; later stages get this rank's slice here."""
    from mgrpo.models.hf_checkpoint import unwrap

    gpt = unwrap(model)
    if mask is None or not gpt.config.num_moe_experts:
        return None
    if gpt.config.sequence_parallel and not gpt.pre_process:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        group = gpt.pg_collection.tp if hasattr(gpt, "pg_collection") else None
        mask = scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous(), group=group).transpose(0, 1)
    return mask.contiguous()


def packed_seq_params(seq_lens: Sequence[int] | torch.Tensor, *, pad_to_multiple_of: int = 1,
                      padded_lens: Optional[Sequence[int]] = None, device: Optional[torch.device | str] = None):
    """megatron's PackedSeqParams (THD format) for sequences laid end to end in one row.

    `cu_seqlens` are the int32 prefix sums [0, l0, l0+l1, ...] that TE's flash / fused attention
    take. When sequences occupy more slots than their length (context parallelism needs each one
    padded to a multiple of 2*cp; FP8 GEMMs want multiples of 16), either `pad_to_multiple_of` > 1
    rounds each length up or `padded_lens` gives the slots; `cu_seqlens_*_padded` are then those
    padded offsets (rotary positions and the CP split follow them) while `cu_seqlens_*` keep the
    real lengths. `max_seqlen_*` is the longest padded sequence. TE's attention consumes THD on a
    GPU; without TE, `ReferenceCoreAttention` (mgrpo/models/attention.py) does.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.as_tensor(seq_lens, dtype=torch.int64).flatten().cpu()
    if lens.numel() == 0 or bool((lens <= 0).any()):
        raise ValueError(f"packed sequence lengths must be positive and non-empty, got {lens.tolist()}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")

    def cumulative(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros(1), x.cumsum(0)]).to(torch.int32).to(device or "cpu")

    cu = cumulative(lens)
    padded = None
    max_len = int(lens.max())
    plens = None
    if padded_lens is not None:
        plens = torch.as_tensor(padded_lens, dtype=torch.int64).flatten().cpu()
        if plens.shape != lens.shape or bool((plens < lens).any()):
            raise ValueError(f"padded_lens {plens.tolist()} must match seq_lens {lens.tolist()} and be >= them")
    elif pad_to_multiple_of > 1:
        plens = (lens + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
    if plens is not None:
        padded = cumulative(plens)
        max_len = int(plens.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
