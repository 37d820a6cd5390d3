"""Exact resume after SIGKILL: the whole run (driver and every Ray process) is killed as soon as it has
published its step-2 checkpoint (`checkpoints/latest`), in the middle of step 3; `trainer.resume=auto`
continues it from the checkpoint `latest` names, and every later step equals the
uninterrupted run's, while metrics.jsonl, trajectories.jsonl and TensorBoard hold each step exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.procs import kill, pids_where
from tests.test_e2e import LOSS_KEYS, read_metrics

STEPS, BATCH, N = 5, 8, 4
ARGS = ["trainer.total_training_steps=5", "trainer.save_freq=2", "trainer.save_hf=false", "data.train_batch_size=8",
        "rollout.n=4", "algorithm.entropy_coeff=0.01", "trainer.logger=[tensorboard]", "trainer.max_ckpt_to_keep=1"]


def train(run_dir: str, ray_tmp: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    return subprocess.Popen([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", *ARGS,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def kill_everything(proc: subprocess.Popen, marker: str) -> int:
    """SIGKILL the driver's process group and every process of its private Ray (found by its temp dir):
    nothing gets to clean up, as when a node dies."""
    os.killpg(proc.pid, signal.SIGKILL)
    killed = 1 + kill(pids_where(marker, f"RAY_TMPDIR={marker}", environ=True))
    proc.wait(timeout=60)
    return killed


def published(run_dir: str) -> str:
    """The checkpoint `checkpoints/latest` names (written once the checkpoint is complete), or ''."""
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def wait_for_checkpoint(run_dir: str, name: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Wait until `latest` names checkpoint `name` (or a later one): the kill must land past it. Timed off
    the published checkpoint, not off metrics lines, so however the machine is loaded it waits for the
    right thing."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if published(run_dir) >= name:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early (rc={proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"checkpoint {name} not published within {timeout_s}s (latest: {published(run_dir)!r})")


@pytest.mark.slow
def test_sigkill_mid_run_resumes_exactly(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-kill-", dir="/tmp")
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    p = train(straight, ray_tmp + "/a")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]

    p = train(killed, ray_tmp + "/b")
    wait_for_checkpoint(killed, "step_000002", p)  # save_freq=2: the run is now in step 3 (or past it)
    assert kill_everything(p, ray_tmp + "/b") > 3  # driver, GCS, raylet, Megatron rank, engine, ...
    resume = published(killed)  # what the killed run published last (step 2, or 4 if it raced ahead)
    assert resume in ("step_000002", "step_000004"), resume
    k = int(resume.split("_")[1])
    p = train(killed, ray_tmp + "/c", "trainer.resume=auto")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out and f"checkpoints/{resume}" in out, out[-3000:]

    a, b = read_metrics(straight), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, STEPS + 1))  # every step exactly once
    for step in range(k + 1, STEPS + 1):
        for key in LOSS_KEYS + ("critic/score/mean", "rollout/weight_version", "actor/lr"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)
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
