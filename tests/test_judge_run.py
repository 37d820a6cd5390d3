"""A run whose only reward is a generative judge (a tiny chat model on its own CPU server, the yes/no parser) goes
on when the judge's engine is SIGKILLed mid-run: the engine is started again (reward/model_restarts) and the call
the kill cut short is sent to it once more, so no sample loses its judgement (none is masked, none scored 0.0), and
every step appears once. (A judge that fails for good masks and counts: tests/test_judge_serving.py.)"""

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
from tests.helpers.runs import read_metrics, train, trajectories


@pytest.mark.integration
def test_a_killed_judge_engine_is_restarted_and_the_run_goes_on(tmp_path):
    judge = str(tmp_path / "judge")
    init_hf_checkpoint(judge, ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512,
                                          init_std=0.1), seed=0, tokenizer=printable_tokenizer())
    template = tmp_path / "judge.j2"
    template.write_text("Q:{{ question }}\nA:{{ response }}\nRight? Y or N")
    models = (f"reward.models={{judge: {{kind: generative, hf_path: '{judge}', timeout_s: 60, judge: "
              f"{{template_file: '{template}', parser: yes_no, yes: Y, no: N, top_logprobs: 107}}}}}}")
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-i33j-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    run = str(tmp_path / "run")
    try:
        proc = train(run, ray_tmp, models, "reward.compose={mgrpo/sum: {judge: 1.0}}",
                     "trainer.total_training_steps=5", "trainer.save_freq=-1")
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        deadline, killed = time.time() + 400, None
        while proc.poll() is None and time.time() < deadline and killed is None:
            metrics = os.path.join(run, "metrics.jsonl")
            if os.path.exists(metrics) and os.path.getsize(metrics) > 0:  # step 1 is written: the judge worked once
                found = pids_where(f"mgrpo.rollout.sglang.cpu.server\0--model-path\0{judge}\0")
                assert len(found) == 1, found
                os.kill(found[0], signal.SIGKILL)
                killed = found[0]
            time.sleep(0.05)
        proc.wait(timeout=max(1.0, deadline - time.time()))
        reader.join(timeout=30)
        out = "".join(lines)
        assert killed is not None and proc.returncode == 0, out[-3000:]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    steps = [m for m in read_metrics(run) if "reward/failed" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]  # each step once
    assert steps[0]["reward/model_restarts"] == 0 and steps[-1]["reward/model_restarts"] == 1
    assert "exited (code -9); starting it again" in out
    # the call the kill cut short went again to the restarted server: no sample lost its judgement
    assert sum(m["reward/failed"] + m["reward/timeouts"] + m["reward/masked_samples"] for m in steps) == 0
    scores = [r["score"] for r in trajectories(run)]
    assert len(scores) == 5 * 8 * 4 and all(0.0 < s < 1.0 for s in scores)  # P(yes) / (P(yes) + P(no)) of a live model, never 0.0
