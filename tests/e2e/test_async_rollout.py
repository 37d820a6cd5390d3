"""Asynchronous rollout on the real stack: one-step-off samples are exactly one weight version behind,
samples beyond the staleness bound are dropped and counted, never trained, and a run killed with its
pipeline full resumes with every step's samples exactly once and the same numbers."""

from __future__ import annotations

import os
import tempfile

import pytest

from mgrpo.components.rollout_pipeline import RolloutPipeline
from mgrpo.loop import Trainer
from tests.helpers.runs import (LOSS_KEYS, kill_everything, read_metrics, small_config, train, trajectories,
                                wait_for_checkpoint)

ASYNC = {"mode": "disaggregated", "async_mode": "one_step_off"}


@pytest.mark.system
def test_one_step_off_trains_on_samples_one_version_behind(tmp_path):
    run_dir = str(tmp_path)
    Trainer(small_config(run_dir, rollout=ASYNC, trainer={"total_training_steps": 5, "n_gpus_per_node": 2})).fit()
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5]
    # step 1 trains on the initial weights' samples; from then on every batch was generated while the
    # previous step trained, i.e. by the weights one version behind the policy that trains it
    assert [x["rollout/staleness_mean"] for x in m] == [0.0, 1.0, 1.0, 1.0, 1.0]
    versions = {(r["step"], r["weight_version"]) for r in trajectories(run_dir)}
    assert versions == {(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)}
    assert all(x["rollout/stale_dropped"] == 0 for x in m)
    # the mismatch guard judges only samples of the trainer's weights: step 1's, none of the later ones
    assert m[0]["rollout/logprob_guard_diff"] == m[0]["rollout/logprob_abs_diff"]
    assert all(x["rollout/logprob_guard_unchecked"] == 1.0 and x["rollout/logprob_guard_streak"] == 0 for x in m[1:])
    # the off-policy gap shows, and truncated importance sampling (on by default when async) measures it
    assert m[0]["rollout/logprob_abs_diff"] < 1e-5 < m[1]["rollout/logprob_abs_diff"]
    # step 1 is on-policy: pi_old is the policy that sampled, ratio 1 everywhere, nothing capped; the later
    # steps' samples are a version behind, so their ratio moves away from 1
    assert m[0]["actor/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m[0]["actor/tis_capped_frac"] == 0.0
    assert all(abs(x["actor/tis_ratio_mean"] - 1.0) > 1e-5 for x in m[1:])


@pytest.mark.system
def test_samples_beyond_the_staleness_bound_are_dropped_never_trained(tmp_path, monkeypatch):
    # The look-ahead rule keeps every sample within the bound, so no run of the real code makes a stale one.
    # Here the producer (a thread of this process) may start three batches ahead of a bound of one, and the first
    # step waits until it has (else, on a loaded machine, the trainer may keep pace and nothing goes stale): batches
    # 2 and 3 are made on version 0 and are two versions old when their steps come, so the consumer's bound must
    # drop them.
    monkeypatch.setattr(RolloutPipeline, "may_start", lambda self, index: index <= self.steps_done + 3)
    consume = RolloutPipeline.next

    def next_once_three_ahead(self, current_version):
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self.next_index >= 4, timeout=600)
        return consume(self, current_version)

    monkeypatch.setattr(RolloutPipeline, "next", next_once_three_ahead)
    run_dir = str(tmp_path)
    cfg = small_config(run_dir, rollout={"mode": "disaggregated", "async_mode": "bounded_staleness",
                                         "max_staleness": 1},
                       trainer={"total_training_steps": 4, "n_gpus_per_node": 2})
    Trainer(cfg).fit()
    m = read_metrics(run_dir)
    per_batch = len(trajectories(run_dir)) // 4  # one batch trained per step
    # step 3 (weights of version 2) finds batches 2 and 3 of version 0: both dropped whole, batch 4 trained
    assert [x["rollout/stale_dropped"] for x in m] == [0, 0, 2 * per_batch, 0]
    assert m[-1]["rollout/stale_dropped_total"] == 2 * per_batch  # counted
    assert sum(x["rollout/stale_dropped"] for x in m) == m[-1]["rollout/stale_dropped_total"]
    for r in trajectories(run_dir):  # trained samples: policy version at step s is s-1
        assert (r["step"] - 1) - r["weight_version"] <= 1, r
    assert all(x["rollout/staleness_max"] <= 1 for x in m)


@pytest.mark.system
def test_kill_with_the_pipeline_full_resumes_each_step_once(tmp_path):
    """SIGKILL once the step-2 checkpoint is published (the next batch ready in the pipeline): the ready batches
    were saved with the checkpoint and are replayed, so the resumed run equals the uninterrupted one."""
    args = ("rollout.mode=disaggregated", "rollout.async_mode=one_step_off", "trainer.n_gpus_per_node=2")
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-async-", dir="/tmp")
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    p = train(straight, ray_tmp + "/a", *args)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    p = train(killed, ray_tmp + "/b", *args)
    wait_for_checkpoint(killed, "step_000002", p)  # the checkpoint with the next batch ready in the pipeline
    kill_everything(p, ray_tmp + "/b")
    assert os.path.isfile(os.path.join(killed, "checkpoints", "step_000002", "pending_rollouts.json"))
    p = train(killed, ray_tmp + "/c", *args, "trainer.resume=auto")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    a, b = read_metrics(straight), read_metrics(killed)
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        for key in LOSS_KEYS + ("critic/score/mean", "rollout/staleness_mean"):
            assert b[step - 1][key] == pytest.approx(a[step - 1][key], abs=1e-6), (step, key)
    rows = trajectories(killed)
    assert all(sum(1 for r in rows if r["step"] == s) == 8 * 4 for s in range(1, 6)) and len(rows) == 5 * 8 * 4


@pytest.mark.system
def test_multi_turn_with_the_long_tail_cut_one_step_off_killed_and_resumed(tmp_path):
    """Multi-turn rollouts (the peek tool task) produced one step ahead, with veRL's over_sample_rate=0.25 and an
    environment whose every fourth episode is slow: each step's 8 x 4 trajectories, of which exactly 8 were cut
    (aborted, counted, out of the loss), appear once; SIGKILL with the next batch ready in the pipeline and
    trainer.resume=auto replays that batch from the checkpoint: no step lost, none twice, every trajectory line
    of a step in it exactly once."""
    args = ("recipe=tool-peek-tiny-cpu", "rollout.mode=disaggregated", "rollout.async_mode=one_step_off",
            "trainer.n_gpus_per_node=2", "rollout.over_sample_rate=0.25",
            "rollout.multi_turn.environment=tests.helpers.agent:SlowEveryFourth",
            "rollout.multi_turn.required_per_group=${rollout.n}")  # ARGS' n=4: every first turn calls the tool
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-async-mt-", dir="/tmp")
    run_dir = str(tmp_path / "killed")
    p = train(run_dir, ray_tmp + "/a", *args)
    wait_for_checkpoint(run_dir, "step_000002", p)
    kill_everything(p, ray_tmp + "/a")
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000002", "pending_rollouts.json"))
    p = train(run_dir, ray_tmp + "/b", *args, "trainer.resume=auto")
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5]
    assert all(x["rollout/aborted"] == 8 and x["multi_turn/finish/aborted"] == 8 for x in m)
    assert all(x["reward/failed"] == 0 and x["reward/masked_samples"] >= 8 for x in m)  # aborted: masked, no failure
    rows = trajectories(run_dir)
    assert all(sum(1 for r in rows if r["step"] == s) == 8 * 4 for s in range(1, 6)) and len(rows) == 5 * 8 * 4
    for s in range(1, 6):
        cut = [r for r in rows if r["step"] == s and r["multi_turn"]["finish_reason"] == "aborted"]
        assert len(cut) == 8 and all(r["score"] is None and r["reward"] is None and r["reward_status"] == "aborted"
                                     and r["failed_by"] == "over_sample" for r in cut), s
