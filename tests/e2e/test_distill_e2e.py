"""On-policy distillation's forward_kl_topk run as a user runs it, with each teacher: the first step's
`actor/opd/forward_kl` (and the top-k masses) against the same numbers computed with transformers from the run's
own samples, the teacher checkpoint and the student's initial weights (its `init_hf`): full-vocabulary
log_softmax, the teacher's top k, veRL's per-token term, the mean over the response tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.integration

K = 4
ARGS = ["trainer.total_training_steps=1", "trainer.save_hf=false", "data.train_batch_size=8", "rollout.n=4",
        "trainer.logger=[tensorboard]", "algorithm.opd.loss_mode=forward_kl_topk", f"algorithm.opd.topk={K}"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    from mgrpo.config import ModelConfig
    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint

    # wider and deeper than the student, the student's tokenizer
    return init_hf_checkpoint(str(tmp_path_factory.mktemp("teacher")), ModelConfig(hidden_size=192, num_layers=3),
                              seed=7, tokenizer=synthetic_tokenizer())


def _expected(run_dir: str, teacher: str, step: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    t_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    s_model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "init_hf"), dtype=torch.float32).eval()
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r["step"] == step]
    kls, s_mass, t_mass = [], [], []
    with torch.no_grad():
        for row in rows:
            p, r = row["prompt_ids"], row["response_ids"]
            ids = torch.tensor([p + r])
            t_lp = torch.log_softmax(t_model(ids).logits[0, len(p) - 1:-1].float(), -1)
            s_lp = torch.log_softmax(s_model(ids).logits[0, len(p) - 1:-1].float(), -1)
            top, at = t_lp.topk(K, -1)
            s = s_lp.gather(-1, at)
            kls.append((top.exp() * (top - s)).sum(-1).clamp_min(0.0))
            s_mass.append(s.exp().sum(-1))
            t_mass.append(top.exp().sum(-1))
    return {"actor/opd/forward_kl": torch.cat(kls).mean().item(),
            "actor/opd/student_topk_mass": torch.cat(s_mass).mean().item(),
            "actor/opd/teacher_topk_mass": torch.cat(t_mass).mean().item()}


@pytest.mark.parametrize("mode", ["megatron", "sglang"])
@pytest.mark.timeout(900)
def test_forward_kl_topk_first_step_equals_transformers(tmp_path, teacher, mode):
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="mgrpo-opd-", dir="/tmp")}  # AF_UNIX paths: short
    proc = subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", *ARGS,
                           f"teacher.hf_path={teacher}", f"teacher.mode={mode}"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:]
    got = read_metrics(run_dir)[-1]
    for key, want in _expected(run_dir, teacher).items():
        assert got[key] == pytest.approx(want, abs=2e-5), key
    assert got["actor/opd/forward_kl"] > 0.05  # a random teacher and student disagree: the term is not 0


@pytest.mark.parametrize("mode", ["megatron", "sglang"])
@pytest.mark.timeout(900)
def test_a_teacher_under_one_step_off_async_rollout(tmp_path, teacher, mode):
    """Asynchronous rollout with each teacher: every step has the teacher's term, and step 1 (the initial weights
    on both sides) equals the transformers computation. The SGLang teacher's line is slime's (its OPD flags, the
    folder mgrpo starts the teacher from as mgrpo's key)."""
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="mgrpo-opd-", dir="/tmp")}
    args = [a for a in ARGS if not a.startswith("trainer.total_training_steps")]
    who = ([f"teacher.hf_path={teacher}"] if mode == "megatron" else
           ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0", f"teacher.hf_path={teacher}"])
    proc = subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", *args,
                           "trainer.total_training_steps=3", *who, "rollout.mode=disaggregated",
                           "trainer.n_gpus_per_node=2", "rollout.async_mode=one_step_off"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert mode == "megatron" or "--opd-type sglang" in proc.stdout  # the translation table was printed
    got = read_metrics(run_dir)
    assert [m["step"] for m in got] == [1, 2, 3] and all(m["actor/opd/forward_kl"] > 0.0 for m in got)
    for key, want in _expected(run_dir, teacher, step=1).items():
        assert got[0][key] == pytest.approx(want, abs=2e-5), key
