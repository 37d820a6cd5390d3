"""A run whose only reward is a generative judge (a tiny chat model on its own CPU server, the yes/no parser) through
both faults a judge run meets: its judge engine SIGKILLed mid-run, then the whole run SIGKILLed after its step-2
checkpoint and resumed with trainer.resume=auto. The engine is started again (reward/model_restarts) and the call the
kill cut short is sent to it once more, so no sample loses its judgement (none masked, none scored 0.0); the judge is
deterministic (temperature 0, P(yes) from its log-probs), so every step of the faulted, resumed run equals the
uninterrupted run's, and each appears once. (A judge that fails for good masks and counts: test_judge_serving.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from mgrpo.config.schema import ModelConfig
from mgrpo.data.printable import printable_tokenizer
from mgrpo.models.hf_io import init_hf_checkpoint
from tests.helpers.procs import pids_where
from tests.helpers.runs import LOSS_KEYS, kill_everything, published, read_metrics, train, trajectories, \
    wait_for_checkpoint

STEPS = 5  # tests/helpers/runs.py ARGS: 5 steps of 8 prompts x 4, a checkpoint every 2


def _judge_args(tmp_path) -> tuple[str, list[str]]:
    judge = str(tmp_path / "judge")
    init_hf_checkpoint(judge, ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512,
                                          init_std=0.1), seed=0, tokenizer=printable_tokenizer())
    template = tmp_path / "judge.j2"
    template.write_text("Q:{{ question }}\nA:{{ response }}\nRight? Y or N")
    return judge, [f"reward.models={{judge: {{kind: generative, hf_path: '{judge}', timeout_s: 60, judge: "
                   f"{{template_file: '{template}', parser: yes_no, yes: Y, no: N, top_logprobs: 107}}}}}}",
                   "reward.compose={mgrpo/sum: {judge: 1.0}}"]


def _kill_judge_after_step_1(run: str, judge: str, proc, timeout_s: float = 600) -> int:
    deadline, metrics = time.time() + timeout_s, os.path.join(run, "metrics.jsonl")
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:  # step 1 is written: the judge worked once
            found = pids_where(f"mgrpo.rollout.sglang.cpu.server\0--model-path\0{judge}\0")
            assert len(found) == 1, found
            os.kill(found[0], signal.SIGKILL)
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"the run ended or stalled before step 1 (rc={proc.poll()})")


@pytest.mark.system
def test_a_judge_run_through_a_killed_judge_and_a_sigkill_resumes_exactly(tmp_path):
    judge, args = _judge_args(tmp_path)
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-i33j-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    try:
        p = train(straight, ray_tmp + "/a", *args)
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]

        p = train(killed, ray_tmp + "/b", *args)
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
        _kill_judge_after_step_1(killed, judge, p)
        wait_for_checkpoint(killed, "step_000002", p)
        assert kill_everything(p, ray_tmp + "/b") > 3
        first = "".join(lines)
        # the killed judge's server is found dead and restarted through its host, in its bundle
        assert "failed its health check; starting it again in its bundle" in first, first[-3000:]
        resume = published(killed)
        k = int(resume.split("_")[1])
        p = train(killed, ray_tmp + "/c", *args, "trainer.resume=auto")
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0 and f"checkpoints/{resume}" in out, out[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    a, b = read_metrics(straight), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, STEPS + 1))  # every step exactly once
    for m in a:  # the judge scores in a driver thread while the ranks compute the (kept) reference forward
        assert 0.0 <= m["timing_s/reward_wait"] <= m["timing_s/reward"], m
    # judged after the forward, nothing would be hidden; here about the forward's time on the ranks is, over the
    # run (one step's share moves with when the judge's thread gets the interpreter: 8 of 20 ms in one run)
    hidden = sum(m["timing_s/reward"] - m["timing_s/reward_wait"] for m in a)
    assert hidden >= 0.5 * sum(min(m["timing_s/reward"], m["timing_s/ref_on_ranks"]) for m in a), a
    for step in range(1, STEPS + 1):  # the killed judge changed nothing; the resume neither
        for key in LOSS_KEYS + ("critic/score/mean", "reward/judge/mean", "actor/lr"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key, k)
    assert sum(m["reward/failed"] + m["reward/timeouts"] + m["reward/masked_samples"] for m in a + b) == 0
    assert max(m["reward/model_restarts"] for m in b[:k]) == 1  # the attempt that was killed restarted the judge
    scores = [r["score"] for r in trajectories(killed)]
    assert len(scores) == STEPS * 8 * 4 and all(0.0 < s < 1.0 for s in scores)  # P(yes) of a live model, never 0.0
