"""mgrpo-plan counts the reward models' engines: accelerators (engines x tp), weights per engine from the
checkpoint's files, and whether the cluster has the accelerators left for them (FITS / DOES NOT FIT)."""

from __future__ import annotations

import os

from mgrpo_launchers.plan import build_plan, compose_config, render
from tests.helpers.reward_models import tiny_classifier


def test_plan_counts_reward_model_engines(tmp_path):
    rm = tiny_classifier(str(tmp_path / "rm"))
    weights = sum(os.path.getsize(os.path.join(rm, f)) for f in os.listdir(rm) if f.endswith(".safetensors"))
    over = [f"reward.models={{rm: {{hf_path: {rm}, engines: 2, tp: 2}}}}", "reward.compose={mgrpo/sum: {rm: 1.0}}"]
    p = build_plan(compose_config(["cluster=gpu", "trainer.n_gpus_per_node=8", "rollout.mode=disaggregated", *over]))
    got = p["reward_models"]
    assert got["models"] == [{"name": "rm", "kind": "classifier", "engines": 2, "tp": 2, "accelerators": 4,
                              "url": None, "weights_bytes": weights}]
    # the trainer and the rollout take every accelerator of the cluster (the world fills what is left): the reward
    # engines have none of their own, and the plan says so rather than launching them onto busy GPUs
    assert p["trainer"]["world"] + p["rollout"]["accelerators"] == 8
    assert got["accelerators"] == 4 and got["cluster_free_accelerators"] == 0 and got["fits"] is False
    text = render(p)
    assert "rm: classifier reward model, 2 engine(s) x tp 2 = 4 accelerator(s)" in text
    assert "DOES NOT FIT: the reward models need 4 accelerator(s); 0 are left" in text
    cpu = build_plan(compose_config(over))
    assert cpu["reward_models"]["accelerators"] == 4 and "one more server process" in render(cpu)
