"""mgrpo-plan: world and DP, placement, batch arithmetic, the memory estimate, and its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mgrpo.config import ModelConfig
from mgrpo_launchers.plan import compose_config, main, param_counts, rank_coords


def plan_json(capsys, *overrides: str) -> dict:
    main(["--json", *overrides])
    return json.loads(capsys.readouterr().out)


def test_world_and_dp_text_and_json(capsys):
    main(["actor.tp=2", "trainer.n_gpus_per_node=4"])
    text = capsys.readouterr().out
    assert "world 4 = tp 2 x pp 1 x cp 1 x dp 2" in text
    assert "1 node(s) x 4 CPU bundles = 4" in text
    p = plan_json(capsys, "actor.tp=2", "trainer.n_gpus_per_node=4")
    assert (p["trainer"]["world"], p["trainer"]["dp"], p["cluster"]["accelerators"]) == (4, 2, 4)
    assert [(r["tp"], r["dp"]) for r in p["trainer"]["ranks"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_tiny_model_memory_matches_a_hand_computation(capsys):
    """qwen3-tiny: V=16, H=128, 2 layers, 4 query heads, 2 KV heads, head_dim 32, SwiGLU 256, tied.

    per layer: qkv 128*(4+2*2)*32 = 32768, proj 4*32*128 = 16384, fc1 128*2*256 = 65536,
    fc2 256*128 = 32768, norms 2*128 + 2*32 = 320 -> 147776.
    tp=1: embedding padded to 128 rows: 128*128 = 16384; + 2 layers + final norm 128 = 312064.
    tp=2: vocab padded to 256, 128 rows per rank: 16384; layers (147456/2 + 320)*2 = 148096; norm 128
          -> 164608 per rank.
    fp32 trainer: weights 4 + grads 4 + Adam 8 + reference 4 = 20 bytes per parameter."""
    p = plan_json(capsys)
    assert p["model"]["params_per_layer"] == 147776
    assert p["model"]["params_megatron"] == 312064
    assert p["model"]["params_hf"] == 16 * 128 + 2 * 147776 + 128 == 297728
    mem = p["memory_per_accelerator"]
    assert mem["params_per_rank"] == 312064
    assert mem["bytes"] == {"actor_weights": 312064 * 4, "actor_grads": 312064 * 4,
                            "optimizer_states": 312064 * 8, "reference_weights": 312064 * 4,
                            "total": 312064 * 20}

    p = plan_json(capsys, "actor.tp=2", "trainer.n_gpus_per_node=4")
    assert p["memory_per_accelerator"]["params_per_rank"] == 164608
    assert p["memory_per_accelerator"]["bytes"]["total"] == 164608 * 20

    main(["actor.tp=2"])
    assert f"= 3.14 MiB ({164608 * 20:,} bytes)" in capsys.readouterr().out


def test_memory_dtype_reference_and_distributed_optimizer(capsys):
    n = 312064
    bf16 = plan_json(capsys, "--dtype", "bf16")["memory_per_accelerator"]["bytes"]
    assert (bf16["actor_weights"], bf16["actor_grads"], bf16["optimizer_states"], bf16["reference_weights"]) == \
        (2 * n, 4 * n, 12 * n, 2 * n)  # bf16 weights, fp32 grads, fp32 master + Adam m, v
    no_ref = plan_json(capsys, "algorithm.use_kl_loss=false")["memory_per_accelerator"]["bytes"]
    assert no_ref["reference_weights"] == 0 and no_ref["total"] == 16 * n
    dist = plan_json(capsys, "trainer.device=cuda", "trainer.n_gpus_per_node=4", "actor.use_distributed_optimizer=true",
                     "--dtype=bf16")["memory_per_accelerator"]["bytes"]
    assert dist["optimizer_states"] == 12 * n // 4  # sharded over DP=4


def test_param_counts_equal_transformers_qwen3():
    """The formula against the parameters transformers builds for the same architecture (on the meta
    device, so the real presets cost nothing)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mgrpo.models.qwen3 import hf_config
    from mgrpo.models.shapes import padded_vocab_size

    presets = [compose_config([f"model={name}"]).model for name in ("tiny", "qwen3-0.6b", "qwen3-8b")]
    untied = ModelConfig(tie_word_embeddings=False, num_layers=3, num_query_groups=4, head_dim=16)
    for m in presets + [untied]:
        with torch.device("meta"):
            model = transformers.Qwen3ForCausalLM(hf_config(m))
        assert param_counts(m)["hf_total"] == sum(p.numel() for p in model.parameters()), m.name
        for tp in (1, 2, 8):
            assert param_counts(m, tp)["padded_vocab"] == padded_vocab_size(m.vocab_size, tp,
                                                                            m.make_vocab_size_divisible_by)
    assert param_counts(presets[2])["hf_total"] == 8_190_735_360  # Qwen3-8B: "8.2B"


def test_pipeline_stages_split_layers_and_vocab():
    m = ModelConfig(tie_word_embeddings=False, num_layers=4)
    c = param_counts(m, tp=2, pp=2)
    layer_rank = (c["layer"] - c["per_layer"]["norms"]) // 2 + c["per_layer"]["norms"]
    emb = c["padded_vocab"] // 2 * m.hidden_size
    assert c["per_rank_by_stage"] == [2 * layer_rank + emb, 2 * layer_rank + m.hidden_size + emb]
    tied = param_counts(ModelConfig(num_layers=4), tp=1, pp=2)  # megatron keeps the tied copy on the last stage
    assert tied["per_rank_by_stage"][1] == tied["per_rank_by_stage"][0] + 128


def test_rank_coordinates_follow_megatron_order():
    ps = pytest.importorskip("megatron.core.parallel_state")
    tp, cp, dp, pp = 2, 1, 2, 2
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for name in ("tp", "dp", "pp"):
        for group in gen.get_ranks(name):
            coords = [rank_coords(r, tp, cp, dp) for r in group]
            # within a group only that coordinate varies, and it counts 0..size-1
            assert [c[name] for c in coords] == list(range(len(group)))
            others = {tuple(v for k, v in c.items() if k != name) for c in coords}
            assert len(others) == 1


def test_multi_node_placement_and_disaggregated_rollout(capsys):
    p = plan_json(capsys, "trainer.nnodes=2", "trainer.n_gpus_per_node=4", "actor.tp=2", "actor.pp=2")
    r4 = p["trainer"]["ranks"][4]
    assert (r4["node"], r4["local"], r4["tp"], r4["pp"], r4["dp"]) == (1, 0, 0, 1, 0)
    assert p["trainer"]["dp"] == 2
    p = plan_json(capsys, "trainer.n_gpus_per_node=4", "actor.tp=2", "rollout.mode=disaggregated",
                  "rollout.num_engines=2")
    assert (p["trainer"]["world"], p["trainer"]["dp"], p["rollout"]["accelerators"]) == (2, 1, 2)
    assert [e["accelerators"] for e in p["rollout"]["engines"]] == [[[0, 2]], [[0, 3]]]
    assert p["cluster"]["ray_cpus_needed"] == 4


def test_batch_arithmetic(capsys):
    b = plan_json(capsys, "data.train_batch_size=32", "rollout.n=8", "actor.ppo_mini_batch_size=8",
                  "actor.ppo_epochs=2", "actor.max_tokens_per_gpu=72", "trainer.n_gpus_per_node=2")["batch"]
    assert b["samples_per_step"] == 256 and b["mini_batches_per_step"] == 4
    assert b["optimizer_steps_per_step"] == 8
    assert b["samples_per_dp_rank_per_mini_batch"] == 32  # 8 prompts x 8 samples over DP 2
    assert b["max_sequence_tokens"] == 36 and b["max_length_samples_per_micro_batch"] == 2
    assert b["micro_batches_per_dp_rank_per_mini_batch_at_most"] == 16


def test_invalid_config_exits_2_naming_the_field():
    out = subprocess.run(["mgrpo-plan", "actor.tp=3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "actor.tp=3 does not divide model.num_attention_heads=4" in out.stderr
    assert out.stdout == ""


def test_unknown_key_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["actor.not_a_key=1"])
    assert info.value.code == 2
    assert "actor.not_a_key" in capsys.readouterr().err


def test_plan_does_not_start_ray_or_import_torch():
    code = ("import sys; from mgrpo_launchers.plan import main; main(['actor.tp=2']); "
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
