"""The log-prob mismatch guard: it counts consecutive steps above trainer.max_logprob_diff, judges only the
samples made with the trainer's weights, stops with a message naming the doctor, and, on a real run, ends
mgrpo-train with exit status 2 and no traceback after logging the steps (which mgrpo-doctor run then reads)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mgrpo.components.logprob_guard import LogprobGuard, LogprobMismatch, logprob_diff_bound
from mgrpo.config import InputError, MGRPOConfig
from mgrpo.config.schema import MAX_LOGPROB_DIFF_DEFAULTS
from mgrpo.config.validate import field_errors
from mgrpo.experience import Experience


def _cfg(**trainer) -> MGRPOConfig:
    cfg = MGRPOConfig()
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, dtype="fp32"),
                               trainer=dataclasses.replace(cfg.trainer, **trainer))


def _exp(diffs: list[list[float]], versions: list[int]) -> Experience:
    rollout = [[-1.0 - 0.1 * k for k in range(len(d))] for d in diffs]
    return Experience(prompt_ids=[[1]] * len(diffs), response_ids=[[2] * len(d) for d in diffs],
                      rollout_logprobs=rollout, finish_reasons=["stop"] * len(diffs), weight_versions=versions,
                      group_index=list(range(len(diffs))),
                      old_logprobs=[[r + x for r, x in zip(ro, d)] for ro, d in zip(rollout, diffs)])


def test_streak_of_steps_above_the_bound_stops_the_run_naming_the_doctor():
    guard = LogprobGuard(_cfg(max_logprob_diff=1e-3, logprob_diff_patience=2), "/runs/a")
    steps = [[[1e-4, 3e-4]], [[2e-3, 4e-3]], [[1e-5, 1e-5]], [[5e-3, 1e-3]], [[float("nan"), 0.0]]]
    streaks = []
    for step, diffs in enumerate(steps, start=1):
        metrics = guard.measure(_exp(diffs, [7] * len(diffs)), 7)
        streaks.append(metrics["rollout/logprob_guard_streak"])
        assert metrics["rollout/logprob_guard_diff"] == pytest.approx(sum(map(abs, diffs[0])) / 2, nan_ok=True)
        if step < 5:
            guard.enforce(step)  # a single step above (2) and a recovery (3) never stop the run
            assert "rollout/logprob_guard_stop" not in metrics
    assert streaks == [0.0, 1.0, 0.0, 1.0, 2.0]  # an engine log-prob that is NaN counts as above the bound
    assert metrics["rollout/logprob_guard_stop"] == 1.0
    with pytest.raises(LogprobMismatch) as err:
        guard.enforce(5)
    assert isinstance(err.value, InputError)  # the launchers print it and exit 2, no traceback
    text = str(err.value)
    assert "steps 4..5" in text and "trainer.max_logprob_diff=0.001" in text and "patience=2" in text
    assert "mgrpo-doctor run /runs/a" in text and "0.003" in text


def test_only_samples_of_the_trainers_weights_are_judged():
    """With asynchronous rollout an older sample differs by the policy's own change: not a mismatch."""
    guard = LogprobGuard(_cfg(max_logprob_diff=1e-3, logprob_diff_patience=1), "/runs/a")
    metrics = guard.measure(_exp([[0.5, 0.5], [1e-6, 3e-6]], [3, 4]), 4)
    assert metrics["rollout/logprob_guard_diff"] == pytest.approx(2e-6)
    assert metrics["rollout/logprob_guard_streak"] == 0.0
    metrics = guard.measure(_exp([[0.5, 0.5]], [3]), 4)  # nothing made with weight version 4
    assert metrics == {"rollout/logprob_guard_unchecked": 1.0, "rollout/logprob_guard_streak": 0.0}
    guard.enforce(2)


def test_defaults_by_dtype_and_off_and_validation():
    assert logprob_diff_bound(_cfg()) == MAX_LOGPROB_DIFF_DEFAULTS["fp32"] == 1e-3
    bf16 = _cfg()
    bf16 = dataclasses.replace(bf16, actor=dataclasses.replace(bf16.actor, dtype="bf16"))
    assert logprob_diff_bound(bf16) == MAX_LOGPROB_DIFF_DEFAULTS["bf16"] == 0.1
    assert logprob_diff_bound(_cfg(max_logprob_diff=0.5)) == 0.5
    off = LogprobGuard(_cfg(logprob_diff_patience=0, max_logprob_diff=1e-9), "/runs/a")
    metrics = off.measure(_exp([[1.0]], [0]), 0)
    off.enforce(1)
    assert metrics == {}
    errors = field_errors(_cfg(max_logprob_diff=0.0, logprob_diff_patience=-1), check_files=False)
    assert any("trainer.max_logprob_diff=0.0 must be positive" in e for e in errors)
    assert any("trainer.logprob_diff_patience=-1" in e for e in errors)


@pytest.mark.integration
def test_a_run_over_the_bound_stops_with_exit_2_and_the_doctor_reads_it(tmp_path):
    """The real stack: fp32 on CPU differs by ~1e-7 per token, so a bound of 1e-12 stops the run after
    `patience` steps; the steps it ran are on disk with token log-probs and the engine that made them."""
    run_dir = str(tmp_path / "run")
    out = subprocess.run(
        [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", "trainer.total_training_steps=6",
         "trainer.max_logprob_diff=1e-12", "trainer.logprob_diff_patience=2", "trainer.save_hf=false",
         "data.train_batch_size=8", "rollout.n=4", "trainer.logger=[console]"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "mgrpo-train: stopped at step 2" in out.stderr and f"mgrpo-doctor run {run_dir}" in out.stderr
    assert "Traceback" not in out.stderr
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["rollout/logprob_guard_streak"] for m in metrics] == [1.0, 2.0]
    assert metrics[1]["rollout/logprob_guard_stop"] == 1.0
    for m in metrics:  # synchronous rollout: the guard judged exactly the run's metric
        assert m["rollout/logprob_guard_diff"] == pytest.approx(m["rollout/logprob_abs_diff"], rel=1e-12)
        assert 0 < m["rollout/logprob_abs_diff"] < 1e-5
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 2 * 8 * 4
    for line in lines:
        assert line["engine"] == 0 and len(line["prompt_ids"]) > 0
        assert len(line["response_ids"]) == len(line["rollout_logprobs"]) == len(line["trainer_logprobs"]) > 0

    doc = subprocess.run([sys.executable, "-m", "mgrpo_launchers.doctor", "run", run_dir, "--json",
                          str(tmp_path / "report.json")], capture_output=True, text=True, timeout=120)
    assert doc.returncode == 0, doc.stderr
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert report["steps"] == 2 and report["lines"] == 64 and report["metric_steps_checked"] == 2
    assert report["metric_agreement"] < 1e-12  # the doctor reads exactly what the run measured
    assert report["concentration"]["engine"]["groups"][0]["group"] == "0"
    assert "mgrpo-doctor layers --engine" in doc.stdout and "init_hf" in doc.stdout


@pytest.mark.system
def test_each_sample_names_the_engine_that_made_it(tmp_path, monkeypatch):
    """Two engines that the rollout group dispatches to (in-process transformers engines, no router): chunk k of
    a step's requests goes to engine k % 2, and each trajectory line says which one answered it. Then the
    doctor's trainer side from the run's checkpoint: equal to its HF export, and an engine left on the initial
    weights (a missed weight sync) parts at the embeddings."""
    import ray

    from mgrpo.loop import Trainer
    from tests.helpers.runs import small_config

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    run_dir = str(tmp_path)
    cfg = small_config(run_dir, trainer={"n_gpus_per_node": 3, "save_hf": True},
                       rollout={"mode": "disaggregated", "num_engines": 2, "engine": "hf", "generate_chunk": 8})
    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, configure_logging=False)  # logical GPUs on a CPU
    Trainer(cfg).fit()  # shuts Ray down at the end
    assert not ray.is_initialized()
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    for step in (1, 2):
        engines = [r["engine"] for r in lines if r["step"] == step]
        assert engines == [(j // 8) % 2 for j in range(32)]  # 8 prompts x 4 samples, chunks of 8
    from mgrpo.doctor.run_report import analyse

    groups = analyse(run_dir)["concentration"]["engine"]["groups"]
    assert [(g["group"], g["tokens"]) for g in groups] == [
        ("0", sum(len(r["response_ids"]) for r in lines if r["engine"] == 0)),
        ("1", sum(len(r["response_ids"]) for r in lines if r["engine"] == 1))]

    from mgrpo.doctor.layers import layers

    ckpt, traj = os.path.join(run_dir, "checkpoints", "step_000002"), os.path.join(run_dir, "trajectories.jsonl")
    same = layers(os.path.join(run_dir, "hf"), trainer=ckpt, trajectory=traj, line=1)
    assert same["trainer_kind"] == "run" and same["comparison"]["kind"] == "agree"
    assert all(x["rel"] == 0.0 for x in same["comparison"]["sites"][:-1])
    stale = layers(os.path.join(run_dir, "init_hf"), trainer=ckpt, trajectory=traj, line=1)
    assert stale["comparison"]["parts_at"] == "embeddings"
