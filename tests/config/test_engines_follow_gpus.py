"""rollout.num_engines unset: colocated and hybrid runs on GPUs put an engine on every rollout.tp GPUs of the job
(veRL's rule, as its translation applies it to veRL lines), and mgrpo-plan says how many GPUs train, generate and
sit idle."""

from __future__ import annotations

import json

import pytest

from mgrpo.config import ConfigError, resolve_device
from mgrpo.config.validate import layout
from mgrpo.preflight import preflight
from mgrpo_launchers.plan import compose_config, main

GPU = ("cluster=gpu", "rollout=sglang", "model=qwen3-0.6b")  # 1 node x 8 GPUs


@pytest.mark.parametrize("overrides, engines, rollout_gpus", [
    ((*GPU,), 8, 8),                                      # tp 1: one engine per GPU
    ((*GPU, "rollout.tp=2"), 4, 8),
    ((*GPU, "rollout.tp=4", "trainer.nnodes=2"), 4, 16),  # 2 x 8 GPUs / 4
    ((*GPU, "rollout.tp=2", "rollout.mode=hybrid"), 4, 8),
    ((*GPU, "rollout.tp=2", "rollout.num_engines=3"), 3, 6),  # a number given is the number used
    ((*GPU, "rollout.mode=disaggregated", "rollout.tp=2"), 1, 2),  # its GPUs come out of the trainer's: 1
    ((), 1, 1),                                            # the CPU job: one engine
    (("actor.tp=2", "trainer.n_gpus_per_node=4"), 1, 1),  # CPU bundles are not GPUs
])
def test_unset_engine_count_follows_the_gpus(overrides, engines, rollout_gpus):
    cfg = compose_config(list(overrides))
    assert cfg.rollout.num_engines in (None, 3)
    lay = layout(cfg)
    assert (lay.num_engines, lay.rollout_devices) == (engines, rollout_gpus)
    assert resolve_device(cfg).rollout.num_engines == engines  # what every part of a run reads


def test_recipes_use_every_gpu_on_any_number_of_nodes():
    for nodes in (1, 2, 4):
        for recipe in ("qwen3-8b-gsm8k-grpo", "qwen3-8b-dapo", "qwen3-8b-dr-grpo"):
            cfg = compose_config([f"recipe={recipe}", f"trainer.nnodes={nodes}"])
            lay = layout(cfg)
            assert lay.num_engines * cfg.rollout.tp == lay.total == 8 * nodes, (recipe, nodes)


def test_same_count_as_the_verl_translation():
    """veRL's rule (GPUs x nodes / rollout TP, mgrpo/compat/verl/layout.py) gives the number an mgrpo line
    now gets unset."""
    from mgrpo.compat.verl import translate

    verl = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=8", "trainer.nnodes=2",
            "actor_rollout_ref.rollout.name=sglang"]
    got = dict(kv.split("=", 1) for kv in translate(verl).args if "=" in kv)
    mgrpo = layout(compose_config([*GPU, "rollout.tp=2", "trainer.nnodes=2"]))
    assert int(got["rollout.num_engines"]) == mgrpo.num_engines == 8


def test_rollout_tp_larger_than_the_job_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.tp=16 is larger than the job's 8 GPUs .*no engine fits"):
        preflight(compose_config([*GPU, "rollout.tp=16"]), check_files=False, check_memory=False)


def test_plan_prints_gpus_per_phase_and_warns_about_idle_ones(capsys):
    main(["recipe=qwen3-8b-gsm8k-grpo", "trainer.nnodes=2"])
    text = capsys.readouterr().out
    assert "rollout   8 sglang engine(s) x tp 2 = 16 accelerator(s)" in text
    assert "(rollout.num_engines unset: one per rollout.tp GPUs of the job)" in text
    assert "GPUs      16 of 16 train, 16 of 16 generate, no reward engines" in text
    assert "warning" not in text

    main(["--json", "recipe=qwen3-8b-gsm8k-grpo", "trainer.nnodes=2", "rollout.num_engines=1"])
    p = json.loads(capsys.readouterr().out)
    assert p["gpus"] | {"warnings": None} == {"total": 16, "training": 16, "generation": 2, "reward_engines": 0,
                                              "teacher_engines": 0, "warnings": None}
    assert p["batch"]["warnings"][0] == ("14 of the 16 GPUs generate nothing: 1 engine(s) x rollout.tp 2 = 2 "
                                         "(rollout.num_engines=null puts one on every rollout.tp GPUs)")
    main(["recipe=qwen3-8b-gsm8k-grpo", "trainer.nnodes=2", "rollout.mode=disaggregated", "rollout.num_engines=4"])
    text = capsys.readouterr().out
    assert "GPUs      8 of 16 train, 8 of 16 generate, no reward engines" in text and "warning" not in text
