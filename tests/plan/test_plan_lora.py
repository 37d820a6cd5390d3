"""The planner's LoRA terms: adapter parameters against Hugging Face peft's count on the same model, and the memory
terms LoRA changes (tests/training/test_lora.py checks the per-rank count against the parameters each rank holds)."""

from __future__ import annotations

import dataclasses

import pytest


def test_adapter_count_is_peft_count_less_the_inputs_megatron_shares():
    """PEFT puts one adapter on each of q/k/v and gate/up; megatron's fused linears share one lora_A per
    group: (2 of 3 + 1 of 2) x rank x hidden fewer parameters per layer, nothing else differs."""
    from peft import LoraConfig as PeftLora, get_peft_model
    from transformers import Qwen3ForCausalLM

    from mgrpo.config.schema import LoraConfig
    from mgrpo.models.qwen3 import hf_config
    from mgrpo.plan.lora import adapter_counts
    from tests.helpers.convert import tiny_cfg

    m, r = tiny_cfg(), 8
    model = get_peft_model(Qwen3ForCausalLM(hf_config(m)), PeftLora(r=r, lora_alpha=16, target_modules="all-linear"))
    peft_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ours = adapter_counts(m, LoraConfig(rank=r), tp=1, pp=1)[0][0]
    assert ours == peft_count - m.num_layers * 3 * r * m.hidden_size, (ours, peft_count)
    # split over ranks: the split halves divide, the whole halves repeat
    tp2 = adapter_counts(m, LoraConfig(rank=r), tp=2, pp=2)[0]
    assert tp2[0] == tp2[1] < ours


@pytest.mark.parametrize("overrides", [["model=qwen3-8b"], ["model=qwen3-30b-a3b", "actor.tp=1", "actor.ep=8"]])
def test_lora_plan_freezes_the_base_and_drops_the_reference(overrides):
    from mgrpo_launchers.plan import build_plan, compose_config

    plan = build_plan(compose_config(["recipe=qwen3-8b-gsm8k-grpo", *overrides, "actor.lora.rank=16",
                                      "actor.use_distributed_optimizer=false"]))
    lo = plan["memory_per_accelerator"]["lora"]
    n = lo["adapter_params_per_rank"]
    assert lo["lora"]["reference_weights"] == 0 and lo["full"]["reference_weights"] > 0
    assert lo["lora"]["actor_grads"] == n * 4  # fp32 gradient buffer of the adapters only
    assert lo["lora"]["optimizer_states"] == n * 12  # Adam m, v and the fp32 master of bf16 adapters
    assert lo["lora"]["actor_weights"] == lo["full"]["actor_weights"] + n * 2
    assert lo["lora"]["peak"] < lo["full"]["peak"]
