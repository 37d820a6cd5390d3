"""Learning as a result: one trainer.seed sets every random stream, a run is a function of its seed on one machine,
and the learning history flags what moved (benchmarks/tools/learning_history.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.tools import learning_history as lh
from mgrpo.config import DataConfig, MGRPOConfig, TrainerConfig


def test_trainer_seed_sets_every_stream():
    cfg = MGRPOConfig(trainer=TrainerConfig(seed=7))
    assert (cfg.data.seed, cfg.actor.seed) == (7, 7)
    # a stream set on its own keeps its seed
    assert MGRPOConfig(data=DataConfig(seed=3), trainer=TrainerConfig(seed=7)).data.seed == 3


def _line(commit: str, lasts: list[float], overrides=()) -> dict:
    runs = {str(i + 1): {"first10": 0.02, "last10": x, "steps": 150, "wall_s": 60.0, "load_1m_at_start": 1.0}
            for i, x in enumerate(lasts)}
    return {"commit": commit, "date_utc": "2026-12-06T00:00:00Z", "overrides": list(overrides),
            "recipes": {"main": lh.summarise("main", runs)}}


def test_history_flags_a_median_drop_and_a_seed_under_the_floor():
    before = _line("a", [0.95, 0.93, 0.96, 0.94, 0.92])
    assert lh.regressions([before], _line("b", [0.94, 0.93, 0.95, 0.92, 0.91])) == []
    dropped = lh.regressions([before], _line("b", [0.90, 0.86, 0.88, 0.87, 0.89]))
    assert dropped == ["main: median last-10 0.94 -> 0.88 (line a)"]
    under = lh.regressions([before], _line("b", [0.95, 0.93, 0.96, 0.94, 0.80]))
    assert under == ["main: 1 of 5 seeds under the floor 0.85 (min 0.8)"]


def test_the_own_task_promises_letters_as_well_as_reward():
    runs = {str(i + 1): {"first10": 0.01, "last10": x, "steps": 150, "wall_s": 60.0, "load_1m_at_start": 1.0,
                         "letters_solved": n} for i, (x, n) in enumerate([(0.93, 25), (0.90, 23), (0.70, 26)])}
    line = {"commit": "b", "date_utc": "2026-12-06T00:00:00Z", "overrides": [],
            "recipes": {"own-task": lh.summarise("own-task", runs)}}
    # seed 2 misses letters with a reward over the floor, seed 3 misses the floor: each counted once
    assert lh.regressions([], line) == ["own-task: 2 of 3 seeds under the floor 0.75, or under 24 of 26 letters "
                                        "(min 0.7)"]
    assert "(23-26 of 26 letters)" in lh.table([line]) and "| 0.75, 24 letters |" in lh.table([line])


def test_the_reward_model_recipe_reads_what_its_job_writes(tmp_path, monkeypatch):
    from benchmarks.jobs import reward_model_sum

    steps = [{"reward/rule/mean": i / 20, "reward/rm/mean": i / 25, "reward/rm/samples_per_s": 100.0,
              "timing_s/step": 0.5} for i in range(20)]

    def job(cmd, **kw):  # the job's own summary of its steps, written where the tool asked
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump(reward_model_sum.summarise(steps), f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(lh.subprocess, "run", job)
    got = lh._reward_model(lh.RECIPES["reward-model"], 1, str(tmp_path), 60.0)
    assert got["rewards"] == [i / 20 for i in range(20)]


def test_a_candidate_line_is_neither_compared_against_nor_shown():
    history = [_line("a", [0.95] * 5), _line("cand", [0.5] * 5, overrides=["actor.lr=1"])]
    assert lh.previous_for(history, "main")["commit"] == "a"
    assert lh.latest(history)["main"]["commit"] == "a"
    assert "| 5 | 0.950 / 0.950 / 0.950 |" in lh.table(history)


def test_committed_history_meets_each_recipes_floor():
    """The newest committed line of each recipe is the promise the docs render: its floor held on every seed
    (the tool task: on 4 of 5)."""
    history = lh.read_history(lh.os.path.join(lh.REPO, "benchmarks", "results", "learning_history.jsonl"))
    newest = lh.latest(history)
    assert "main" in newest, "benchmarks/results/learning_history.jsonl has no line for the main job"
    for name, got in newest.items():
        recipe = lh.RECIPES[name]
        allowed = len(got["seeds"]) - recipe.min_passing if recipe.min_passing else 0
        assert got["under_floor"] <= allowed, (name, got["commit"], got["min"], recipe.floor)


@pytest.mark.system
@pytest.mark.parametrize("mode", [(), lh.RECIPES["async-bounded"].overrides], ids=["synchronous", "async-bounded"])
def test_a_run_is_a_function_of_its_seed(tmp_path, mode):
    """Two runs with one trainer.seed give identical metrics (timings aside, and how far the asynchronous producer
    had read the data when a step was logged); another seed gives others."""
    def run(name: str, seed: int) -> list[dict]:
        out = tmp_path / name
        subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={out}",
                        f"trainer.seed={seed}", "trainer.total_training_steps=12", *mode], check=True,
                       capture_output=True, timeout=900)
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        return [{k: v for k, v in m.items() if k not in ("time", "data/epoch")
                 and not k.startswith(("timing_s/", "perf/", "memory/"))} for m in rows]

    a, b, c = run("a", 3), run("b", 3), run("c", 4)
    assert len(a) == 12 and a == b
    assert [m["critic/score/mean"] for m in a] != [m["critic/score/mean"] for m in c]


def test_lines_of_one_commit_count_together():
    """Seeds run in two invocations at one commit make one summary; another commit starts afresh."""
    history = [_line("a", [0.5]), _line("b", [0.9, 0.8]), _line("b", [0.95, 0.9, 0.85])]
    got = lh.latest(history)["main"]
    assert got["commit"] == "b" and len(got["seeds"]) == 3 and got["median"] == 0.9
