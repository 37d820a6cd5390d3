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
    assert got["models"] == [{"name": "rm", "kind": "classifier", "engines": 2, "tp": 2, "placement": "own",
                              "accelerators": 4, "shared_accelerators": 0, "gpu_memory_utilization": 0.8,
                              "url": None, "weights_bytes": weights}]
    # the trainer and the rollout take every accelerator of the cluster (the world fills what is left): the reward
    # engines have none of their own, and the plan says so rather than launching them onto busy GPUs
    assert p["trainer"]["world"] + p["rollout"]["accelerators"] == 8
    assert got["accelerators"] == 4 and got["cluster_free_accelerators"] == 0 and got["fits"] is False
    text = render(p)
    assert "rm: classifier reward model (SGLang --is-embedding), 2 engine(s) x tp 2 = 4 accelerator(s)" in text
    assert "DOES NOT FIT: own accelerators 4 of 0 left" in text
    assert "placement=own needs 4 accelerator(s); 0 are left beside the trainer's and the rollout's" in text
    cpu = build_plan(compose_config(over))
    assert cpu["reward_models"]["accelerators"] == 4 and "one more server process" in render(cpu)


def test_plan_counts_reward_engines_that_share_the_rollouts_cards(tmp_path):
    """placement=shared: the engines sit on the rollout's cards; their share is counted against the rollout engine's
    share while generating and against the trainer's peak while training (colocated: the same cards)."""
    rm = tiny_classifier(str(tmp_path / "rm"))
    gpu = ["cluster=gpu", "trainer.n_gpus_per_node=8", "rollout.mode=colocated", "reward.compose={mgrpo/sum: {rm: 1.0}}"]

    def plan(**m):
        spec = ", ".join(f"{k}: {v}" for k, v in {"hf_path": rm, "placement": "shared", **m}.items())
        return build_plan(compose_config([*gpu, f"reward.models={{rm: {{{spec}}}}}"]))

    p = plan(engines=2, tp=2)
    got = p["reward_models"]
    assert got["fits"] and got["problems"] == [] and got["accelerators"] == 0
    assert got["models"][0]["shared_accelerators"] == 4 and got["shared_share_per_card"] == 0.15
    mem = p["memory_per_accelerator"]
    train_peak = max(t["total"] for name, t in mem["phases"].items() if name != "generation")
    assert got["training_peak_with_rewards"] == int(train_peak + 0.15 * mem["capacity"])
    assert p["gpus"]["reward_engines"] == 0
    text = render(p)
    assert "2 engine(s) x tp 2 on the rollout's accelerators (0.15 of each card)" in text and "FITS: own" in text

    # the rollout's 0.7 of a card plus 0.3 for the reward engine passes what a card holds
    bad = plan(engines=2, tp=2, gpu_memory_utilization=0.3)["reward_models"]
    assert not bad["fits"] and bad["problems"] == [
        "generation: rollout.gpu_memory_utilization 0.7 + the shared reward engines' 0.30 = 1.00 of a card, past 0.95"]
    # more engines than the rollout has cards
    many = plan(engines=5, tp=2)["reward_models"]
    assert not many["fits"] and "10 accelerator(s) to share, but the rollout has 8" in many["problems"][0]
    # the trainer's peak plus the reward share past the card: a card of 8 GiB
    small = build_plan(compose_config([*gpu, f"reward.models={{rm: {{hf_path: {rm}, placement: shared, "
                                              "gpu_memory_utilization: 0.2}}"]), gpu_mem_gb=8)
    sm = small["reward_models"]
    phases, cap = small["memory_per_accelerator"]["phases"], small["memory_per_accelerator"]["capacity"]
    peak = max(t["total"] for name, t in phases.items() if name != "generation")
    assert sm["fits"] == (peak + 0.2 * cap <= cap)
    assert any(x.startswith("training: the trainer's peak") for x in sm["problems"]) == (peak + 0.2 * cap > cap)


def test_plan_counts_the_sglang_teachers_engines(tmp_path):
    """teacher.mode=sglang: teacher.num_engines x teacher.tp accelerators of their own, beside the trainer's and the
    rollout's, with the checkpoint's weights per engine (a Megatron teacher is a row of the memory table instead)."""
    from mgrpo.config import ModelConfig
    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint

    teacher = init_hf_checkpoint(str(tmp_path / "teacher"), ModelConfig(hidden_size=192, num_layers=3), seed=7,
                                 tokenizer=synthetic_tokenizer())
    weights = sum(os.path.getsize(os.path.join(teacher, f)) for f in os.listdir(teacher) if f.endswith(".safetensors"))
    over = [f"teacher.hf_path={teacher}", "teacher.mode=sglang", "teacher.num_engines=2", "teacher.tp=2"]
    gpu = ["cluster=gpu", "rollout.mode=disaggregated", "rollout.num_engines=2", *over]
    full = build_plan(compose_config([*gpu, "trainer.n_gpus_per_node=4"]))
    got = full["reward_models"]
    assert got["models"] == [{"name": "teacher", "kind": "teacher", "engines": 2, "tp": 2, "placement": "own",
                              "accelerators": 4, "shared_accelerators": 0, "gpu_memory_utilization": 0.5,
                              "url": None, "weights_bytes": weights}]
    assert full["gpus"]["teacher_engines"] == 4 and not got["fits"]
    assert "placement=own and the teacher need 4 accelerator(s); 0 are left" in got["problems"][0]
    text = render(full)
    assert "teacher   on-policy distillation teacher (SGLang, log-probs of the student's tokens), 2 engine(s) x " \
           "tp 2 = 4 accelerator(s)" in text and "4 more for the teacher's engines" in text
    megatron = build_plan(compose_config([f"teacher.hf_path={teacher}"]))
    assert megatron["reward_models"]["models"] == [] and megatron["gpus"]["teacher_engines"] == 0
