"""The chaos soak in short (`python -m benchmarks.jobs.chaos` runs the long one): one 20-step run of the default
job with two engines behind SGLang's router takes three faults of three kinds in sequence — an engine server
SIGKILLed (healed in the run), the router SIGKILLed (healed: a new router in front of the engines) and the
driver SIGKILLed (fatal: the harness resumes with trainer.resume=auto, as a SLURM requeue does). At the end
every step is in metrics.jsonl, TensorBoard and trajectories.jsonl exactly once with all its samples,
every fault is counted (the healed ones in the run's own run-long counters, the fatal one in the
harness's events) and the final HF export equals a run without faults, bit for bit. The multi-turn job takes
a hanging tool and a crashing environment the same way (healed by trajectory retries, exactly)."""

from __future__ import annotations

import pytest

from tests.helpers import chaos
from tests.helpers.procs import still_running

STEPS, BATCH, N = 20, 8, 4
KINDS = ["engine_kill", "router_kill", "driver_kill"]


@pytest.mark.integration
def test_descendants_reach_grandchildren_that_renamed_themselves():
    """What a SIGKILLed driver leaves: the raylet's agents are the driver's grandchildren and overwrite their
    command line and environment when they rename themselves, so the harness must find them by the tree."""
    import subprocess
    import sys

    agent = "import setproctitle, time; setproctitle.setproctitle('ray::Agent'); time.sleep(60)"
    raylet = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {agent!r}]); time.sleep(60)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {raylet!r}]); time.sleep(60)"
    driver = subprocess.Popen([sys.executable, "-c", code])
    try:
        from tests.helpers.procs import until_none

        def grandchildren():
            return [p for p in chaos.descendants(driver.pid) if p not in chaos.children(driver.pid)]

        renamed = lambda: any(chaos._proc(p, "cmdline").startswith("ray::Agent") for p in grandchildren())  # noqa: E731
        assert not until_none(lambda: not renamed(), 20)  # until_none: waits while its answer is truthy
        found = grandchildren()
        assert len(found) == 1 and chaos._proc(found[0], "cmdline").startswith("ray::Agent")
        assert set(chaos.children(driver.pid)) < set(chaos.descendants(driver.pid))
    finally:
        pids = chaos.descendants(driver.pid)
        driver.kill()
        chaos.kill_all(pids)
        driver.wait(timeout=10)


def test_schedule_is_seeded_and_covers_every_kind():
    a = chaos.make_schedule(0, 200, 12, list(chaos.KINDS))
    assert a == chaos.make_schedule(0, 200, 12, list(chaos.KINDS))  # the seed decides everything
    assert a != chaos.make_schedule(1, 200, 12, list(chaos.KINDS))
    assert {f.kind for f in a} == set(chaos.KINDS) and len(a) == 12
    steps = [f.at_step for f in a]
    assert steps == sorted(set(steps)) and 3 <= steps[0] and steps[-1] <= 198  # distinct, in order, room to heal
    with pytest.raises(SystemExit, match=f"cannot cover {len(chaos.KINDS)} kinds"):
        chaos.make_schedule(0, 200, 3, list(chaos.KINDS))


@pytest.mark.system
def test_three_faults_in_one_run_end_equal_to_a_run_without_faults(tmp_path):
    lines: list[str] = []
    r = chaos.soak_job("default", [], steps=STEPS, faults=3, seed=0, kinds=KINDS, batch=BATCH, n=N,
                       workdir=str(tmp_path), log=lines.append)
    assert sorted(f["kind"] for f in r["faults"]) == sorted(KINDS), "\n".join(lines)
    assert r["records"] == {"metrics_steps_once": True, "tensorboard_steps_once": True,
                            "trajectory_steps_once": True, "samples_complete": True}
    # two attempts: the driver's SIGKILL ended the first; the second resumed from the step-10 checkpoint
    assert [a["exit_code"] for a in r["attempts"]] == [-9, 0]
    assert r["attempts"][1]["resumed_from_step"] == 10
    healed = [f for f in r["faults"] if not f["fatal"]]
    assert all(f["counted"] == "run metrics" and f["in_final_records"] for f in healed), healed
    # each healed fault restarted exactly one process (the engine, the router), both in the final run's count
    assert r["final_counters"]["rollout/restarts_total"] == 2.0
    assert r["final_counters"]["reward/failed_total"] == 0.0 and r["final_counters"]["reward/timeouts_total"] == 0.0
    fatal = next(f for f in r["faults"] if f["fatal"])
    assert fatal["expected_exit"] and sum(e["event"] == "fault" for e in r["events"]) == 3
    v = r["vs_uninterrupted"]
    assert v["hf_max_abs_diff"] == 0.0 and v["hf_tensors"] > 0
    assert v["first_step_metrics_differ"] is None and v["first_step_samples_differ"] is None
    assert not still_running(str(tmp_path), environ=True)  # nothing of either run is left running


@pytest.mark.system
def test_a_hanging_tool_and_a_crashing_environment_are_healed_exactly(tmp_path):
    """The multi_turn job (the peek task, two in-process engines) whose tool and environment are a user's file
    (tests/helpers/chaos_tools.py): the tool hangs past tool_timeout_s on one call, the environment raises on one
    step. Each is healed by rollout.multi_turn.trajectory_retries (the trajectory generated again with the same
    per-turn seeds), counted in the run's own counter, and the final export equals the run without faults."""
    lines: list[str] = []
    kinds = ["tool_hang", "env_crash"]
    assert chaos.job_kinds("multi_turn", kinds) == kinds and chaos.job_kinds("default", kinds) == []
    r = chaos.soak_job("multi_turn", [], steps=8, faults=2, seed=0, kinds=kinds, batch=4, n=4,
                       workdir=str(tmp_path), log=lines.append)
    assert sorted(f["kind"] for f in r["faults"]) == sorted(kinds), "\n".join(lines)
    assert r["user_code_faults_not_taken"] == []  # each fault fired in the user's code
    assert r["records"] == {"metrics_steps_once": True, "tensorboard_steps_once": True,
                            "trajectory_steps_once": True, "samples_complete": True}
    assert [a["exit_code"] for a in r["attempts"]] == [0]  # healed in the run: no resume
    assert all(f["counted"] == "run metrics" and f["in_final_records"] for f in r["faults"]), r["faults"]
    # one retry per fault, nothing failed, nothing committed as a reward
    assert r["final_counters"]["multi_turn/trajectory_retries_total"] == 2.0
    assert r["final_counters"]["reward/failed_total"] == 0.0
    v = r["vs_uninterrupted"]
    assert v["hf_max_abs_diff"] == 0.0 and v["hf_tensors"] > 0, v
    assert v["first_step_metrics_differ"] is None and v["first_step_samples_differ"] is None, v
    assert not still_running(str(tmp_path), environ=True)
