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
