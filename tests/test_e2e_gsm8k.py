"""GSM8K end to end on CPU: the converter's records, the real Qwen3 tokenizer and chat template, the
GSM8K judge and evaluation, on a tiny random model (learning is not expected at that size)."""

import json
import os

import pytest
from hydra import compose, initialize_config_dir

from mgrpo.data.gsm8k import convert_gsm8k
from mgrpo.loop import Trainer
from mgrpo_launchers.train import CONFIG_DIR, to_config

GSM8K_RAW = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(GSM8K_RAW), reason="../shared/data/gsm8k is not beside the checkout")
def test_gsm8k_tiny_cpu_recipe_runs_with_evaluation(tmp_path):
    data_dir = tmp_path / "gsm8k"
    convert_gsm8k(GSM8K_RAW, str(data_dir), "parquet")
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[
            "recipe=gsm8k-tiny-cpu", f"data.train_files=[{data_dir}/train.parquet]",
            f"data.val_files=[{data_dir}/test.parquet]", f"trainer.output_dir={run_dir}",
            "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_hf=false"]))
    assert cfg.model.vocab_size == 151936 and cfg.model.tokenizer == "qwen3"
    Trainer(cfg).fit()
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    val = [m for m in metrics if "val/openai/gsm8k/score" in m]
    assert [m["step"] for m in val] == [0, 2]  # before training and at test_freq
    assert {"val/openai/gsm8k/mean@2", "val/openai/gsm8k/pass@2"} <= set(val[0])
    train = [m for m in metrics if "critic/score/mean" in m]
    assert [m["step"] for m in train] == [1, 2]
    # A random model's entropy over Qwen3's vocabulary is close to log(151936) = 11.93.
    assert 10.0 < train[0]["rollout/entropy"] < 11.94
    assert train[0]["rollout/logprob_abs_diff"] < 1e-4
    row = json.loads(open(run_dir / "trajectories.jsonl").readline())
    assert row["prompt"].startswith("<|im_start|>user\n") and row["data_source"] == "openai/gsm8k"
