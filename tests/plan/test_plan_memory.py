"""The planner's memory model against the real thing on CPU.

1. The per-layer activation formula of the local spec equals, byte for byte, what autograd saves
   for a decoder layer of megatron's GPTModel (saved_tensors_hooks, unique storages), under GQA,
   without GQA, with one key/value head per TP rank, at TP 1 and 2.
2. The whole CPU estimate of a rank against the measured peak RSS of the Megatron actor running a
   step's phases (benchmarks/measure/plan_memory_cpu.py): within 25%.
"""

from __future__ import annotations


import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.plan_memory import _measure, _check


# (hidden, ffn, heads, kv heads, head_dim, sequences, sequence length)
SHAPES = [(128, 256, 4, 2, 32, 4, 64),    # GQA, 2 kv heads
          (128, 256, 4, 4, 32, 2, 96),    # no GQA
          (256, 512, 8, 2, 64, 3, 40)]    # GQA; at TP 2 one kv head per rank


def _saved_per_layer(rank, world, port, tp, shapes):
    """Bytes of the unique non-parameter storages autograd saves in a forward, 2 layers minus 1 layer."""
    import torch

    from mgrpo.config import ModelConfig
    from mgrpo.models.gpt import build_gpt_model, transformer_config
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, tp=tp, pp=1)
    out = []
    for h, f, nq, nkv, hd, b, s in shapes:
        saved = []
        for layers in (1, 2):
            m = ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=f, num_attention_heads=nq,
                            num_query_groups=nkv, head_dim=hd, vocab_size=16)
            gpt = build_gpt_model(m, transformer_config(m, tp=tp, use_cpu=True), pre_process=True, post_process=True,
                                  pg_collection=ctx.pg_collection)
            storages = {}

            def pack(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            tokens = torch.randint(0, 16, (b, s), generator=torch.Generator().manual_seed(0))
            mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                gpt(tokens, torch.arange(s).expand(b, s), attention_mask=mask)
            params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
            saved.append(sum(n for ptr, n in storages.items() if ptr not in params))
        out.append(saved[1] - saved[0])
    destroy_parallel()
    return out


@pytest.mark.integration
@pytest.mark.parametrize("tp", [1, 2])
def test_layer_activation_formula_equals_what_autograd_saves(tp):
    from mgrpo.plan.memory import Shape, layer_activations
    from mgrpo.config import ModelConfig

    measured = run_ranks(_saved_per_layer, tp, tp, SHAPES)[0]
    for (h, f, nq, nkv, hd, b, s), got in zip(SHAPES, measured):
        m = ModelConfig(hidden_size=h, ffn_hidden_size=f, num_attention_heads=nq, num_query_groups=nkv, head_dim=hd)
        assert layer_activations(m, Shape(b * s, b, s, 0, 1), tp, 4, "local") == got, (h, f, nq, nkv, hd, b, s)


@pytest.mark.integration
def test_cpu_estimate_matches_measured_peak_tiny():
    """tiny model, TP=1, 2 micro-batches of 16 x 256 tokens: activations dominate (~0.2 GiB)."""
    _check(_measure("tiny-tp1pp1"))


@pytest.mark.system
@pytest.mark.parametrize("case", ["tiny-tp2pp1", "tiny-tp1pp2"])
def test_cpu_estimate_matches_measured_peak_tiny_parallel(case):
    _check(_measure(case))
