"""actor.lora as users write it: veRL's two LoRA layouts translate to the same mgrpo keys, and bad LoRA input is
one line naming the key (through the validator here; through mgrpo-train, exit 2, in the integration test)."""

from __future__ import annotations

import os
import subprocess

import pytest

from mgrpo.compat.verl import VerlKeyError, translate
from mgrpo_launchers.plan import compose_config


def test_verl_flat_and_megatron_lora_keys_mean_the_same_config():
    flat = translate(["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                      "actor_rollout_ref.model.target_modules=all-linear"])
    nested = translate(["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.alpha=32",
                        "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
                        "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                        "actor_rollout_ref.model.lora.lora_B_init_method=zero",
                        "actor_rollout_ref.model.lora.merge=false",
                        "actor_rollout_ref.model.lora.a2a_experimental=true",
                        "actor_rollout_ref.actor.megatron.use_mbridge=true"])
    a, b = compose_config(flat.args).actor.lora, compose_config(nested.args).actor.lora
    assert (a.rank, a.alpha, a.target_modules) == (16, 32.0, ["all-linear"])
    assert (b.rank, b.alpha, b.init_a) == (16, 32.0, "kaiming")
    assert b.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    table = dict(nested.rows)
    assert table["actor_rollout_ref.model.lora.a2a_experimental=true"].startswith("ignored: Megatron-Bridge")
    assert table["actor_rollout_ref.actor.megatron.use_mbridge=true"].startswith("ignored: mgrpo converts")
    off = translate(["actor_rollout_ref.model.lora_rank=0"])
    assert compose_config(off.args).actor.lora.rank is None
    xavier = translate(["actor_rollout_ref.model.lora.rank=8",
                        "actor_rollout_ref.model.lora.lora_A_init_method=xavier"])
    assert compose_config(xavier.args).actor.lora.init_a == "xavier"


def test_verl_lora_settings_mgrpo_lacks_are_refused_with_the_reason():
    with pytest.raises(VerlKeyError, match="lora_B_init_method=kaiming: mgrpo starts lora_B at zero"):
        translate(["actor_rollout_ref.model.lora.lora_B_init_method=kaiming"])
    with pytest.raises(VerlKeyError, match="exclude_modules"):
        translate(["actor_rollout_ref.model.lora.exclude_modules=[linear_proj]"])


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.rank=0"], "actor.lora.rank=0: a LoRA rank is at least 1"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[lm_head]"],
     "actor.lora.target_modules: 'lm_head' matches no module"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[experts]"],
     "'experts' matches no module: the model has no experts"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"], "q_proj without k_proj"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha=0.0: must be > 0"),
    (["actor.lora.rank=8", "actor.lora.modules_to_save=[norm]"],
     "actor.lora.modules_to_save: 'norm' is not a module this actor can train whole"),
    (["actor.lora.rank=8", "actor.lora.sync=adapters"], "actor.lora.sync='adapters': choose from auto, adapter"),
    (["actor.lora.rank=8", "actor.lora.sync=adapter", "rollout=hf_cpu"],
     "actor.lora.sync=adapter cannot be used: rollout.engine=hf: only SGLang engines load adapters"),
    (["actor.lora.rank=8", "actor.lora.sync=adapter", "actor.lora.modules_to_save=[embed_tokens]"],
     "actor.lora.sync=adapter cannot be used: actor.lora.modules_to_save=['embed_tokens']"),
    (["actor.lora.rank=8", "actor.lora.sync=adapter", "model=tiny-moe"],
     "actor.lora.sync=adapter cannot be used: adapters on a mixture-of-experts model's experts"),
])
def test_bad_lora_input_is_one_line_naming_the_key(overrides, message):
    from mgrpo.config.validate import validate

    cfg = compose_config(["trainer.device=cpu", *overrides])
    with pytest.raises(Exception) as info:
        validate(cfg, check_files=False)
    assert message in str(info.value), str(info.value)


def test_auto_sync_sends_the_adapters_alone_where_the_engines_can_take_them():
    from mgrpo.components.assemble import adapter_sync
    from mgrpo.rollout.factory import lora_launch_args

    def cfg(*extra):
        return compose_config(["trainer.device=cpu", "actor.lora.rank=8", *extra])

    assert adapter_sync(cfg()) and not adapter_sync(cfg("rollout=hf_cpu"))
    assert not adapter_sync(cfg("actor.lora.modules_to_save=[embed_tokens]"))
    assert not adapter_sync(cfg("model=tiny-moe")) and adapter_sync(cfg("model=tiny-moe",
                                                                         "actor.lora.target_modules=[linear_qkv]"))
    assert not adapter_sync(cfg("actor.lora.sync=merged"))
    assert lora_launch_args(cfg("actor.lora.target_modules=[linear_qkv,linear_fc2]", "rollout.mode=disaggregated")) \
        == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
            "down_proj"]
    assert lora_launch_args(cfg("actor.lora.sync=merged")) == []


@pytest.mark.integration
def test_mgrpo_train_exits_2_on_a_moe_target_for_a_dense_model():
    out = subprocess.run(["mgrpo-train", "actor.lora.rank=8", "actor.lora.target_modules=[experts]"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2, out.stderr
    assert "actor.lora.target_modules: 'experts' matches no module: the model has no experts" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 3, out.stderr
