"""veRL's reward-model keys through the command-line front door: reward_model.enable with its model path becomes
reward.models.rm (the model scores every data_source, as veRL's reward managers return rm_scores), its serving keys
are accepted and named as ignored, and the rest of veRL's seed example (run_qwen2-7b_rm.sh) is refused only for its
critic (adv_estimator=gae)."""

from __future__ import annotations

import pytest

from mgrpo.compat.verl import VerlKeyError, translate
from mgrpo_launchers.plan import compose_config

RM_KEYS = ["reward_model.enable=True", "reward_model.model.path=/models/FsfairX-LLaMA3-RM-v0.1",
           "reward_model.micro_batch_size_per_gpu=32", "reward_model.model.use_remove_padding=True",
           "reward_model.model.fsdp_config.param_offload=True"]


def test_reward_model_keys_translate_and_gae_is_refused_naming_the_critic():
    t = translate(RM_KEYS + ["reward_model.model.input_tokenizer=/models/Qwen2-7B-Instruct",
                                 "algorithm.adv_estimator=grpo"])
    cfg = compose_config(t.args)
    rm = cfg.reward.models["rm"]
    assert (rm.hf_path, rm.batch_size, rm.kind) == ("/models/FsfairX-LLaMA3-RM-v0.1", 32, "classifier")
    assert dict(cfg.reward.compose) == {"*": {"rm": 1.0}}
    off = compose_config(translate(["reward_model.enable=False"]).args)
    assert off.reward.models == {} and off.reward.compose == {}
    with pytest.raises(VerlKeyError, match="needs reward_model.model.path"):
        translate(["reward_model.enable=True"])
    with pytest.raises(VerlKeyError) as info:
        translate(RM_KEYS[:3] + ["algorithm.adv_estimator=gae"])
    assert "algorithm.adv_estimator=gae: gae needs a critic" in str(info.value)
    assert "reward_model" not in str(info.value)  # the reward model keys themselves are honoured


NEW_LAYOUT = ["reward.reward_model.enable=True", "reward.reward_model.model_path=/models/FsfairX-LLaMA3-RM-v0.1",
              "reward.reward_model.enable_resource_pool=True", "reward.reward_model.n_gpus_per_node=4",
              "reward.reward_model.nnodes=1", "reward.reward_model.rollout.name=sglang",
              "reward.reward_model.rollout.tensor_model_parallel_size=2",
              "reward.reward_model.rollout.gpu_memory_utilization=0.5",
              "reward.reward_model.rollout.free_cache_engine=True", "reward.reward_manager.name=naive",
              "reward.reward_manager.source=register", "reward.custom_reward_function.path=pkg://my_rewards.math",
              "reward.custom_reward_function.name=score", "algorithm.adv_estimator=grpo",
              "trainer.n_gpus_per_node=8"]  # veRL's GPU layout, asked for (a line that names none keeps the machine's)


def test_verl_newer_reward_layout_translates_and_the_plan_counts_its_pool():
    """veRL's reward.* layout (reward.reward_model.*, model_path, reward.custom_reward_function.*, pkg:// paths): its
    own resource pool becomes placement=own with GPUs / TP engines, the global pool placement=shared; mgrpo-plan
    (the second front door) counts the engines and says DOES NOT FIT where the trainer and rollout take every GPU."""
    from mgrpo_launchers.plan import build_plan, render

    t = translate(NEW_LAYOUT)
    cfg = compose_config(t.args)
    rm = cfg.reward.models["rm"]
    assert (rm.hf_path, rm.engines, rm.tp, rm.placement, rm.gpu_memory_utilization) == \
        ("/models/FsfairX-LLaMA3-RM-v0.1", 2, 2, "own", 0.5)
    assert dict(cfg.reward.compose) == {"*": {"rm": 1.0}}
    assert dict(cfg.reward.custom_functions) == {"*": "my_rewards.math:score"}
    assert "vllm" not in t.render() and "reward.reward_model.rollout.free_cache_engine=True" in t.render()
    p = build_plan(cfg)
    assert p["reward_models"]["accelerators"] == 4 and p["reward_models"]["fits"] is False
    assert "placement=own needs 4 accelerator(s); 0 are left" in render(p)

    # the global pool (veRL's default): the rollout's cards, the legacy layout the same way
    for keys in (["reward.reward_model.enable=True", "reward.reward_model.model_path=/m/rm"],
                 ["reward_model.enable=True", "reward_model.model.path=/m/rm", "reward_model.enable_resource_pool=False"]):
        shared = compose_config(translate(keys).args)
        assert (shared.reward.models["rm"].placement, shared.reward.models["rm"].engines) == ("shared", 1)
        assert build_plan(shared)["reward_models"]["fits"] is True
    # refused by name: a pool that does not divide into engines, SandboxFusion, another reward manager source
    for bad, why in [(["reward.reward_model.enable=True", "reward.reward_model.model_path=/m",
                       "reward.reward_model.n_gpus_per_node=3", "reward.reward_model.enable_resource_pool=True"], "3 GPUs do not divide into engines"),
                     (["reward.sandbox_fusion.url=http://sandbox:8080"], "reward.sandbox_fusion.url=http://sandbox"
                                                                         ":8080: SandboxFusion code execution"),
                     (["reward.reward_manager.source=importlib"], "reward.reward_manager.source=importlib"),
                     (["reward.reward_model.enable=True"], "needs reward.reward_model.model_path")]:
        with pytest.raises(VerlKeyError, match=why):
            translate(bad)


# veRL's current reward.yaml (verl-project/verl 1dda039, verl/trainer/config/reward/reward.yaml) at its defaults,
# and the same settings in the older layout (reward_manager.yaml, sandbox_fusion.*): accepted, each with its row
REWARD_YAML_DEFAULTS = ["reward.num_workers=8", "reward.custom_reward_function.path=null",
                        "reward.custom_reward_function.name=compute_score", "reward.reward_manager.source=register",
                        "reward.reward_manager.name=naive", "reward.reward_manager.module.path=null",
                        "reward.reward_manager.module.name=custom_reward_manager", "reward.reward_model.enable=False",
                        "reward.reward_model.enable_resource_pool=False", "reward.reward_model.n_gpus_per_node=8",
                        "reward.reward_model.nnodes=0", "reward.reward_model.model_path=null",
                        "reward.sandbox_fusion.url=null", "reward.sandbox_fusion.max_concurrent=64",
                        "reward.sandbox_fusion.memory_limit_mb=1024"]
LEGACY_DEFAULTS = ["reward_manager.source=register", "reward_manager.name=naive", "reward_manager.module.path=null",
                   "reward_manager.module.name=custom_reward_manager", "sandbox_fusion.url=null",
                   "sandbox_fusion.max_concurrent=64", "custom_reward_function.path=null", "reward_model.enable=False"]


def test_verls_reward_yaml_defaults_are_accepted_in_both_layouts():
    for keys in (REWARD_YAML_DEFAULTS, LEGACY_DEFAULTS):
        t = translate(keys)
        cfg = compose_config(t.args)
        assert cfg.reward.models == {} and cfg.reward.custom_functions == {}
        rows = dict(t.rows)
        assert all(k in rows or k == "reward.num_workers=8" for k in keys), [k for k in keys if k not in rows]
    assert compose_config(translate(REWARD_YAML_DEFAULTS).args).reward.num_workers == 8  # the same key in mgrpo
    for bad in ("reward.reward_manager.module.path=my_manager.py", "reward_manager.name=prime",
                "reward.reward_kwargs.some_kwarg=10"):
        with pytest.raises(VerlKeyError, match="reward.custom_functions"):
            translate([bad])
