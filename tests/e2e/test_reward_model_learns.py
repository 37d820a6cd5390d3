"""The default job with a trained reward model as its only reward learns the sum task by the rule's measure
(the rule computed beside it at weight 0): rule accuracy <= 0.3 over the first 10 steps, and over the last 10 the
reward-model recipe's floor in the learning history.
The reward model is trained here by the shipped script's function (benchmarks/jobs/reward_model_sum.py), served by
the CPU server's /classify, and configured through the Python front door."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.jobs.reward_model_sum import JOB_OVERRIDES, train_reward_model
from mgrpo.config import MGRPOConfig
from mgrpo.config.reward import RewardModelConfig
from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics


@pytest.mark.system
def test_default_job_learns_from_a_reward_model_alone(tmp_path):
    # the script's changes of the default job (why: its docstring), applied below as the script applies them
    assert JOB_OVERRIDES == ("algorithm.norm_adv_by_std_in_grpo=false",)
    rm = train_reward_model(str(tmp_path / "rm"))
    assert rm["rm_right_answer_ranked_first"] == 1.0, rm
    cfg = MGRPOConfig()
    cfg = dataclasses.replace(
        cfg,
        reward=dataclasses.replace(cfg.reward, models={"rm": RewardModelConfig(hf_path=str(tmp_path / "rm"),
                                                                             batch_size=256)},
                                   compose={"mgrpo/sum": {"rm": 1.0}}),
        algorithm=dataclasses.replace(cfg.algorithm, norm_adv_by_std_in_grpo=False),
        trainer=dataclasses.replace(cfg.trainer, output_dir=str(tmp_path / "run"), logger=["tensorboard"],
                                    save_hf=False))
    Trainer(cfg).fit()
    steps = [m for m in read_metrics(str(tmp_path / "run")) if "reward/rule/mean" in m]
    assert len(steps) == cfg.trainer.total_training_steps
    rule = [m["reward/rule/mean"] for m in steps]
    model = [m["reward/rm/mean"] for m in steps]
    assert [m["critic/score/mean"] for m in steps] == pytest.approx(model, abs=1e-4)  # the model is the reward
    first, last = sum(rule[:10]) / 10, sum(rule[-10:]) / 10
    from benchmarks.tools.learning_history import RECIPES

    assert first <= 0.3 and last >= RECIPES["reward-model"].floor, (first, last)
    assert sum(model[-10:]) > sum(model[:10])
    assert sum(m["reward/masked_samples"] for m in steps) == 0
