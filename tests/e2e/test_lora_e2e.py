"""LoRA in the loop with adapter-only weight sync (actor.lora.sync=adapter): the engines keep the base they started
from and take only the adapters (PEFT layout, through SGLang's /load_lora_adapter_from_tensors) after each step,
and generate with them (lora_path). The engine's and the trainer's log-probs of the sampled tokens agree within
1e-5 at every step, after the adapters moved the policy off the base, colocated and disaggregated, with
sampled supports (top-k / top-p), and on the tiny MoE at EP2 with routing replay from the engine (R3; adapters on
the attention, which SGLang's LoRA takes; adapters on experts sync merged); the bytes sent per sync are the
adapters' alone."""

from __future__ import annotations

import pytest

from tests.helpers.runs import read_metrics, small_config

LORA = dict(rank=8, alpha=32.0)


def _adapter_bytes(m, r: int, mlp: bool) -> int:
    """fp32 bytes of PEFT's q/k/v/o (and gate/up/down) adapters (q/k/v and gate/up each carry their own A)."""
    h, q, kv, ffn = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, \
        m.ffn_hidden_size
    shapes = [(h, q), (h, kv), (h, kv), (q, h)] + ([(h, ffn), (h, ffn), (ffn, h)] if mlp else [])
    return 4 * m.num_layers * sum(r * i + o * r for i, o in shapes)


CASES = {
    "colocated": dict(rollout=dict(mode="colocated")),
    "disaggregated": dict(rollout=dict(mode="disaggregated"), trainer=dict(n_gpus_per_node=2)),
    "moe-ep2-r3": dict(actor=dict(ep=2, router_replay="rollout"), trainer=dict(n_gpus_per_node=2),
                       lora=dict(target_modules=["linear_qkv", "linear_proj"])),
}


@pytest.mark.system
@pytest.mark.parametrize("case", list(CASES))
def test_adapter_sync_engine_and_trainer_agree(tmp_path, case):
    import dataclasses

    from mgrpo.loop import Trainer
    from tests.helpers.moe import tiny_moe

    c = CASES[case]
    groups = dict(actor=dict(lr=2e-2, **c.get("actor", {})),
                  rollout=dict(top_k=5, top_p=0.9, **c.get("rollout", {})),
                  algorithm=dict(logprob_support="sampled", entropy_coeff=0.01),
                  trainer=dict(total_training_steps=3, **c.get("trainer", {})))
    if case.startswith("moe"):
        groups["model"] = tiny_moe(router_aux_loss_coef=0.001)
    cfg = small_config(str(tmp_path), **groups)
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(
        cfg.actor, lora=dataclasses.replace(cfg.actor.lora, sync="adapter", **LORA, **c.get("lora", {}))))
    Trainer(cfg).fit()
    steps = read_metrics(str(tmp_path))
    assert len(steps) == 3
    want = _adapter_bytes(cfg.model, LORA["rank"], mlp="lora" not in c)
    for i, s in enumerate(steps):
        assert s["rollout/logprob_abs_diff_max"] <= 1e-5, (i, s["rollout/logprob_abs_diff_max"])
        assert s["perf/update_weights_bytes"] == want, (s["perf/update_weights_bytes"], want)
    # the adapters moved the policy: its KL to the base is far above rounding by the last step
    assert steps[-1]["actor/kl_loss"] > 1e-4, steps[-1]["actor/kl_loss"]
