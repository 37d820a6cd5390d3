"""Helpers shared by the conversion tests (this module holds no tests itself).

Small random Qwen3 models built with transformers, with every tensor random (norm weights too, so
a swapped or misplaced norm changes the logits), saved as HF directories; and the pieces each
gloo rank runs: build its pipeline stage, run a forward pass through megatron's forward-only
schedule, gather vocab-parallel logits.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from mgrpo.config import ModelConfig


V = 100  # not a multiple of 128: exercises vocabulary padding at every TP size


def tiny_cfg(**kw) -> ModelConfig:
    """GQA (4 query heads, 2 kv heads), head_dim 24 != hidden/heads = 16, 4 layers."""
    base = dict(name="tiny", vocab_size=V, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                head_dim=24, ffn_hidden_size=96, tie_word_embeddings=False, init_std=0.1,
                max_position_embeddings=64, rope_theta=10000.0)
    base.update(kw)
    return ModelConfig(**base)


def make_hf_checkpoint(out_dir: str, cfg: ModelConfig, seed: int = 0, max_shard_size: str | None = None) -> str:
    """A random transformers Qwen3ForCausalLM saved with save_pretrained (sharded if max_shard_size)."""
    from transformers import Qwen3ForCausalLM

    from mgrpo.models.qwen3 import hf_config

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf_config(cfg)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    return out_dir


def hf_state(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, read with safetensors directly."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, f)))
    return out


def hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def token_ids(cfg: ModelConfig, batch: int = 2, seq: int = 12, seed: int = 123) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# inside a gloo rank


def init_rank(rank: int, world_size: int, port: int, tp: int, pp: int):
    from mgrpo.training.parallel import init_parallel

    return init_parallel(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, tp=tp, pp=pp)


def build_stage(cfg: ModelConfig, ctx, dtype=torch.float32):
    from mgrpo.models.gpt import build_gpt_model, transformer_config

    tf = transformer_config(cfg, tp=ctx.tp, pp=ctx.pp, use_cpu=True, params_dtype=dtype)
    model = build_gpt_model(cfg, tf, pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage,
                            pg_collection=ctx.pg_collection)
    return model.eval()


def layout_kwargs(ctx) -> dict:
    return dict(tp_rank=ctx.tp_rank, tp_size=ctx.tp, pp_rank=ctx.pp_rank, pp_size=ctx.pp)


def export_kwargs(ctx) -> dict:
    return dict(tp_group=ctx.tp_group, tp_size=ctx.tp, pp_rank=ctx.pp_rank, pp_size=ctx.pp)


def megatron_logits(model, ctx, cfg: ModelConfig, ids: torch.Tensor):
    """Full-vocabulary logits [b, s, vocab_size] on last-stage ranks (None elsewhere), through
    megatron's forward-only pipeline schedule; TP shards of the vocabulary are all-gathered."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        out = chunk(ids, pos, None)

        def loss_func(output):
            return output.sum() * 0.0, {"logits": output.detach()}

        return out, loss_func

    with torch.no_grad():
        res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                          num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ctx.is_last_stage:
        return None
    local = res[0]["logits"]
    if ctx.tp > 1:
        parts = [torch.empty_like(local) for _ in range(ctx.tp)]
        dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[..., : cfg.vocab_size]


def cfg_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    return fast
