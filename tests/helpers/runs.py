"""The default job made small, and runs of it as a user starts them (`python -m mgrpo_launchers.train` in its
own process group with a private Ray temp dir), with what the tests read back: metrics.jsonl and
trajectories.jsonl lines, and the checkpoint `checkpoints/latest` publishes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

from mgrpo.config import MGRPOConfig
from tests.helpers.procs import kill, pids_where


def small_config(run_dir: str, **groups) -> MGRPOConfig:
    """The default job, shortened to 8 prompts x 4 samples per step, with a dense user reward and a
    small entropy bonus so that losses and gradients are non-zero from the first step (the exact-match
    reward of a random model is almost always 0 at this batch size, which would make every
    comparison below one of zeros)."""
    cfg = MGRPOConfig()
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, train_batch_size=8),
        rollout=dataclasses.replace(cfg.rollout, n=4),
        algorithm=dataclasses.replace(cfg.algorithm, entropy_coeff=0.01),
        reward=dataclasses.replace(cfg.reward, custom_functions={"mgrpo/sum": "tests.helpers.reward_fns:dense_sum_reward"}),
        trainer=dataclasses.replace(cfg.trainer, output_dir=run_dir, device="cpu", total_training_steps=2,
                                    logger=["tensorboard"], save_hf=False),
    )
    for group, fields in groups.items():
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})
    return cfg


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def trajectories(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        return [json.loads(line) for line in f]


LOSS_KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


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
