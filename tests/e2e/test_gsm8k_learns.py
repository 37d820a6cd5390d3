"""recipe=gsm8k-tiny-cpu learns what it says it learns: on the real data path (mgrpo-prepare's records, the
real Qwen3 tokenizer and chat template, the GSM8K judge with veRL's format credit) the tiny random model goes
from answering with a number a third of the time to always, in 12 steps. The responses are judged again
here with the judge's own answer extraction, independently of the reward the run logged. The same run checks
the path itself: the records, the Qwen3 vocabulary and chat template, evaluation's mean@n/pass@n, step-1
agreement of engine and trainer."""

from __future__ import annotations

import json
import os

import pytest
from hydra import compose, initialize_config_dir

from mgrpo.data.gsm8k import convert_gsm8k
from mgrpo.loop import Trainer
from mgrpo.rewards.gsm8k import extract_solution
from mgrpo_launchers.train import CONFIG_DIR, to_config
from tests.helpers import GSM8K_RAW



def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.system
@pytest.mark.skipif(not os.path.isdir(GSM8K_RAW), reason="../shared/data/gsm8k is not beside the checkout")
def test_gsm8k_tiny_cpu_recipe_learns_to_answer_with_a_number(tmp_path):
    data_dir = tmp_path / "gsm8k"
    convert_gsm8k(GSM8K_RAW, str(data_dir), "parquet")
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[
            "recipe=gsm8k-tiny-cpu", f"data.train_files=[{data_dir}/train.parquet]",
            f"data.val_files=[{data_dir}/test.parquet]", f"trainer.output_dir={run_dir}", "trainer.save_hf=false"]))
    assert (cfg.reward.gsm8k.method, cfg.reward.gsm8k.format_score, cfg.trainer.total_training_steps) == \
        ("flexible", 0.1, 12)
    assert cfg.model.vocab_size == 151936 and cfg.model.tokenizer == "qwen3"
    Trainer(cfg).fit()

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = {m["step"]: m for m in metrics if "critic/score/mean" in m}
    val = {m["step"]: m["val/openai/gsm8k/score"] for m in metrics if "val/openai/gsm8k/score" in m}
    assert sorted(train) == list(range(1, 13)) and sorted(val) == [0, 12]
    first, last = _mean([train[s]["critic/score/mean"] for s in (1, 2, 3)]), \
        _mean([train[s]["critic/score/mean"] for s in (10, 11, 12)])
    assert first < 0.05 and last >= 0.095, (first, last)
    assert val[0] < 0.06 and val[12] >= 0.095, val
    # A random model's entropy over Qwen3's vocabulary is close to log(151936) = 11.93; by step 12 it has collapsed
    # onto a few answer tokens (below 2.0 with torch.multinomial's draws; 2.87 with rollout/categorical.py's, the same
    # distribution drawn with other random numbers, in .ci/run at 55a393e).
    assert 11.9 < train[1]["rollout/entropy"] < 11.94 and train[12]["rollout/entropy"] < 4.0
    assert train[1]["rollout/logprob_abs_diff"] < 1e-4
    first_val = next(m for m in metrics if m["step"] == 0 and "val/openai/gsm8k/score" in m)
    assert {"val/openai/gsm8k/mean@2", "val/openai/gsm8k/pass@2"} <= set(first_val)
    row = json.loads(open(run_dir / "trajectories.jsonl").readline())
    assert row["prompt"].startswith("<|im_start|>user\n") and row["data_source"] == "openai/gsm8k"

    # the same, judged again from the responses: how many hold an answer (a number) at all
    answered = {}
    for line in open(run_dir / "trajectories.jsonl"):
        row = json.loads(line)
        answered.setdefault(row["step"], []).append(extract_solution(row["response"], "flexible") is not None)
    assert all(len(v) == 64 for v in answered.values())  # 8 prompts x n 8
    assert _mean(answered[1]) < 0.5 and _mean(answered[12]) == 1.0
