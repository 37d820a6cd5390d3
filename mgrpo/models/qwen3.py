"""Qwen3 (dense) as a Megatron-Core GPTModel.

Qwen3 is a GPT with RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, RMSNorm on queries
and keys (qk_layernorm), no biases, and a head_dim independent of hidden_size / num_heads. This
module maps `ModelConfig` onto megatron's TransformerConfig and layer spec; it holds no process
groups (they come in through `pg_collection`) and no training logic.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mgrpo.config import ModelConfig


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron shards the embedding and output layer by rows; pad so every TP shard is equal."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config(model: ModelConfig, *, tp: int = 1, pp: int = 1, cp: int = 1, use_cpu: bool,
                       params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                       fp8: Optional[str] = None, fp8_recipe: str = "delayed"):
    """TransformerConfig for Qwen3 at the given parallel layout.

    On CPU the fused CUDA kernels (softmax, bias-dropout, RoPE, grad-accumulation fusion) are off and
    weights are initialised on the CPU, which also makes the initial weights independent of TP size.
    """
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    kwargs = dict(
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
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
    if use_cpu:
        kwargs.update(
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            cross_entropy_loss_fusion=False,
            attention_backend=AttnBackend.local,
        )
    else:
        kwargs.update(attention_backend=AttnBackend.auto, bias_activation_fusion=True, apply_rope_fusion=True)
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe=fp8_recipe)
    return TransformerConfig(**kwargs)


def layer_spec(*, use_te: bool):
    """Decoder layer spec: Transformer Engine modules on GPU, megatron's local modules on CPU."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


def build_gpt_model(model: ModelConfig, tf_config, *, pre_process: bool, post_process: bool,
                    pg_collection=None, use_te: bool = False, vocab_padded: Optional[int] = None):
    """One pipeline stage of Qwen3 as a GPTModel."""
    from megatron.core.models.gpt import GPTModel

    tp = tf_config.tensor_model_parallel_size
    return GPTModel(
        config=tf_config,
        transformer_layer_spec=layer_spec(use_te=use_te),
        vocab_size=vocab_padded or padded_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        pg_collection=pg_collection,
    )


def hf_config(model: ModelConfig, **extra):
    """The transformers `Qwen3Config` describing the same architecture."""
    from transformers import Qwen3Config

    return Qwen3Config(
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
        torch_dtype="float32",
        **extra,
    )
