"""Exact resume after SIGKILL: the whole run (driver and every Ray process) is killed as soon as it has
published its step-2 checkpoint (`checkpoints/latest`), in the middle of step 3; `trainer.resume=auto`
continues it from the checkpoint `latest` names, and every later step equals the
uninterrupted run's, while metrics.jsonl, trajectories.jsonl and TensorBoard hold each step exactly once. Also with
LoRA and adapter-only sync: the resumed run loads the checkpoint's adapters into the engines (which restart from
the base), so engine and trainer log-probs agree again from the first resumed step."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests.helpers.runs import LOSS_KEYS, read_metrics
from tests.helpers.runs import train, kill_everything, published, wait_for_checkpoint

STEPS, BATCH, N = 5, 8, 4
LORA = ("actor.lora.rank=8", "actor.lora.alpha=32", "actor.lr=2e-2", "actor.lora.sync=adapter")
TEACHER, SGLANG_TEACHER = ("teacher",), ("teacher.mode=sglang",)
"""A teacher (wider and deeper than the student) scoring every step, in the Megatron ranks or on an SGLang engine
of its own (killed with the rest, started again on resume): its term resumes exactly too."""


def _teacher(tmp_path) -> tuple[str, ...]:
    from mgrpo.config import ModelConfig
    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint

    path = init_hf_checkpoint(str(tmp_path / "teacher"), ModelConfig(hidden_size=192, num_layers=3), seed=7,
                              tokenizer=synthetic_tokenizer())
    return (f"teacher.hf_path={path}",)


@pytest.mark.system
@pytest.mark.parametrize("extra", [(), LORA, TEACHER, SGLANG_TEACHER],
                         ids=["full", "lora-adapter-sync", "megatron-teacher", "sglang-teacher"])
def test_sigkill_mid_run_resumes_exactly(tmp_path, extra):
    if extra in (TEACHER, SGLANG_TEACHER):
        extra = _teacher(tmp_path) + (() if extra == TEACHER else extra)
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-kill-", dir="/tmp")
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    p = train(straight, ray_tmp + "/a", *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]

    p = train(killed, ray_tmp + "/b", *extra)
    wait_for_checkpoint(killed, "step_000002", p)  # save_freq=2: the run is now in step 3 (or past it)
    assert kill_everything(p, ray_tmp + "/b") > 3  # driver, GCS, raylet, Megatron rank, engine, ...
    resume = published(killed)  # what the killed run published last (step 2, or 4 if it raced ahead)
    assert resume in ("step_000002", "step_000004"), resume
    k = int(resume.split("_")[1])
    p = train(killed, ray_tmp + "/c", "trainer.resume=auto", *extra)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out and f"checkpoints/{resume}" in out, out[-3000:]

    a, b = read_metrics(straight), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, STEPS + 1))  # every step exactly once
    for step in range(k + 1, STEPS + 1):
        for key in LOSS_KEYS + ("critic/score/mean", "rollout/weight_version", "actor/lr") + \
                (("opd/reverse_kl", "opd/teacher_logprob") if "opd/reverse_kl" in a[step - 1] else ()):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)
        assert b[step - 1]["rollout/logprob_abs_diff_max"] <= 1e-5, step  # the engines hold the resumed weights
    with open(os.path.join(killed, "trajectories.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert all(steps.count(s) == BATCH * N for s in range(1, STEPS + 1)) and len(steps) == STEPS * BATCH * N

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(killed, "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("actor/pg_loss")] == list(range(1, STEPS + 1))
    # keep-last-k: only the newest checkpoint is left
    assert sorted(d for d in os.listdir(os.path.join(killed, "checkpoints")) if d.startswith("step_")) == \
        ["step_000005"]
