"""A run whose judge fails on a quarter of the samples goes on: each step appears once, the failed samples are
masked and counted (per step, per judge, run-long), their trajectory lines say so with score null. (The refusal
past reward.failed.max_rate is tested where it is raised, tests/algorithms/test_failed_samples.py.)"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.helpers.runs import read_metrics, train, trajectories

FN = "reward.custom_functions={mgrpo/sum: tests.helpers.reward_fns:failing_on_3_reward}"


@pytest.mark.integration
def test_a_failing_judge_masks_and_counts_and_the_run_goes_on(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-i33-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    try:
        _run(tmp_path, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _run(tmp_path, ray_tmp: str) -> None:
    run = tmp_path / "run"
    proc = train(str(run), ray_tmp, FN, "trainer.total_training_steps=3", "trainer.save_freq=-1")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    steps = [m for m in read_metrics(str(run)) if "reward/failed" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]  # each step once
    failed = [m["reward/failed"] for m in steps]
    assert sum(failed) > 0 and all(m["reward/failed/rule:mgrpo/sum"] == m["reward/failed"] for m in steps)
    assert all(m["reward/masked_samples"] >= m["reward/failed"] for m in steps)
    assert steps[-1]["reward/failed_total"] == sum(failed)
    rows = trajectories(str(run))
    bad = [r for r in rows if "3" in r["response"]]
    assert bad and all(r["score"] is None and r["reward_status"] == "failed" and r["advantage"] == 0.0 for r in bad)
    assert all(r["score"] is not None for r in rows if "3" not in r["response"])
