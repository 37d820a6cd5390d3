"""Learning as a result: every shipped CPU recipe over several seeds, one line per run appended to a history, and
a loud line when a recipe learns less than it did.

    python -m benchmarks.tools.learning_history                          # the fast recipes, seeds 1-5
    python -m benchmarks.tools.learning_history --recipes main,topk --seeds 1 2
    python -m benchmarks.tools.learning_history --tier slow --seeds 1 2 3   # the slow recipes
    python -m benchmarks.tools.learning_history --update-results         # append to benchmarks/results/
    python -m benchmarks.tools.learning_history --show                   # the table of the committed history
    python -m benchmarks.tools.learning_history --recipes main -- actor.lr=1e-3   # a candidate setting

Each recipe is `mgrpo-train` with the overrides below (or a proof job) and `trainer.seed=S`, run in a child
process into a temporary folder. Per recipe and seed: the mean reward of the first and last 10 steps, steps, wall
time and the machine's load; per recipe: min / median / max over the seeds and the recipe's floor. The line is
appended to the history (outputs/benchmarks/learning_history.jsonl, or benchmarks/results/ with
--update-results). REGRESSION is printed (exit 1 with --fail-on-regression) when a recipe's median is more than
0.05 under the last committed line that ran it, or a seed's last-10 is under the recipe's floor.

Rewards are a function of the seed on one machine (a test runs the main job twice); the same seed on another CPU
or another torch/transformers build may draw other samples, so compare lines by their medians over seeds.
The README's and docs' learning figures are rendered from the committed history (`--write`, `--check`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from benchmarks import REPO, add_output_args, checkout_state, output_path
from benchmarks.tools.proctree import machine

ASYNC = ("rollout.mode=disaggregated", "trainer.n_gpus_per_node=2")
"""Asynchronous rollout overlaps generation with training: the engine needs a place of its own."""
TOP_K = ("rollout.top_k=10", "rollout.top_p=0.9", "algorithm.logprob_support=sampled", "rollout.n=16",
         "actor.lr=3e-4")
"""top_k=10 of the 16-token vocabulary: at top_k=5 an answer digit outside every prompt's top-5 is never drawn,
so no group ever scores it (seeds 2 and 3 ended at 0.748 and 0.713, their failing prompts never sampling the
digits 1, 2, 3, 6); entropy 0 or 0.03 did not bring them in (seed 2: 0.55 and 0.43 at step 128). At top_k=10
seed 2 ends at 0.993."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    overrides: tuple[str, ...]
    floor: float
    """Every seed's last-10 reward must reach this (the recipe's promise; a test's bound is this number)."""
    what: str
    slow: bool = False
    runner: str = "train"
    """train: mgrpo-train with the overrides; own_task: the README's own-task block; reward_model: the proof job."""
    min_passing: Optional[int] = None
    """Seeds of 5 that must reach the floor (None: all)."""
    min_letters: Optional[int] = None
    """own_task: letters of the 26 every seed must answer right in its last 10 steps (the task's promise; the
    reward's floor alone would pass a run that never finds a few letters, as partial credit counts)."""


RECIPES: dict[str, Recipe] = {
    "main": Recipe((), 0.85, "the main job (`mgrpo-train`, SGLang-protocol CPU server)"),
    "main-hf": Recipe(("rollout=hf_cpu",), 0.85, "the main job on the in-process engine (`rollout=hf_cpu`)"),
    "main-tp2": Recipe(("actor.tp=2",), 0.8, "the main job at TP2"),
    "main-pp2": Recipe(("actor.pp=2",), 0.8, "the main job at PP2"),
    "main-cp2": Recipe(("actor.cp=2",), 0.8, "the main job at CP2"),
    "topk": Recipe(TOP_K, 0.8, "top-k 10 / top-p 0.9 with sampled support (" + " ".join(TOP_K) + ")"),
    # samples a version or two old: at the main job's lr 5e-4 one-step-off seed 4 ended at 0.705 and bounded
    # staleness seed 2 at 0.721; at 3e-4, 0.898 and 0.916
    "async-one-step-off": Recipe(ASYNC + ("rollout.async_mode=one_step_off", "actor.lr=3e-4"), 0.8,
                                 "one-step-off asynchronous rollout (disaggregated engine, actor.lr=3e-4)"),
    "async-bounded": Recipe(ASYNC + ("rollout.async_mode=bounded_staleness", "rollout.max_staleness=2",
                                     "actor.lr=3e-4"), 0.8,
                            "bounded-staleness asynchronous rollout (max_staleness 2, actor.lr=3e-4)"),
    "main-lora": Recipe(("actor.lora.rank=16", "actor.lora.alpha=32", "actor.lr=1e-3",
                         "actor.lora.modules_to_save=[embed_tokens]"), 0.8,
                        "the main job with LoRA rank 16 and the (tied) embedding trained whole "
                        "(`actor.lora.modules_to_save=[embed_tokens]`, merged sync)", slow=True),
    "moe-r3": Recipe(("model=tiny-moe", "actor.router_replay=rollout"), 0.8, "Qwen3-MoE (tiny-moe) with R3"),
    "moe-r3-ep2": Recipe(("model=tiny-moe", "actor.router_replay=rollout", "actor.ep=2"), 0.8,
                         "Qwen3-MoE with R3 at EP2", slow=True),
    "own-task": Recipe((), 0.75, "the README's own task (letters to capitals, a user's reward file)", slow=True,
                       runner="own_task", min_letters=24),
    "tool": Recipe(("recipe=tool-peek-tiny-cpu",), 0.8, "the tool task (`recipe=tool-peek-tiny-cpu`)", slow=True,
                   min_passing=4),
    "reward-model": Recipe((), 0.8, "the main job rewarded by a trained reward model (rule accuracy)", slow=True,
                           runner="reward_model"),
}


def _rewards(run_dir: str, key: str = "critic/score/mean") -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m[key] for m in map(json.loads, f) if key in m]


def _train(recipe: Recipe, seed: int, tmp: str, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={tmp}", f"trainer.seed={seed}",
           *recipe.overrides, *EXTRA]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-800:]}")
    return {"rewards": _rewards(tmp)}


def own_task_block() -> str:
    """The own-task recipe's bash block, from the page that shows it (README.md or docs/)."""
    pattern = re.compile(r"<!-- recipe:own-task -->\n```bash\n(.*?)```\n<!-- /recipe:own-task -->", re.S)
    for page in ["README.md", *sorted(f"docs/{p}" for p in os.listdir(os.path.join(REPO, "docs")))]:
        path = os.path.join(REPO, page)
        if os.path.isfile(path):
            found = pattern.search(open(path).read())
            if found:
                return found.group(1)
    raise RuntimeError("no page holds the '<!-- recipe:own-task -->' block")


def letters_solved(run_dir: str, last_step: int) -> int:
    """Letters answered right (reward 1.0) in the last 10 steps' trajectories."""
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return len({r["prompt"] for r in rows if r["step"] > last_step - 10 and r["reward"] == 1.0})


def _own_task(recipe: Recipe, seed: int, tmp: str, timeout_s: float) -> dict:
    # the block as a user runs it, in an empty folder; mgrpo-train gets the seed as one more override
    extra = " ".join(f"'{o}'" for o in EXTRA)
    script = f"mgrpo-train() {{ command mgrpo-train \"$@\" trainer.seed={seed} {extra}; }}\n" + own_task_block()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-800:]}")
    run_dir = os.path.join(tmp, "outputs", "mgrpo", "upper")
    rewards = _rewards(run_dir)
    return {"rewards": rewards, "letters_solved": letters_solved(run_dir, len(rewards))}


def _reward_model(recipe: Recipe, seed: int, tmp: str, timeout_s: float) -> dict:
    out = os.path.join(tmp, "rm.json")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.jobs.reward_model_sum", "--out", out, "--",
                           f"trainer.seed={seed}", *EXTRA], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-800:]}")
    with open(out) as f:
        got = json.load(f)
    return {"rewards": got["rule_accuracy"]}  # per step, as the job's summarise() writes it


EXTRA: list[str] = []
"""Overrides added to every mgrpo-train run (the command line's trailing `-- key=value ...`): a candidate."""

RUNNERS: dict[str, Callable[[Recipe, int, str, float], dict]] = {
    "train": _train, "own_task": _own_task, "reward_model": _reward_model}


def run_one(recipe: Recipe, seed: int, timeout_s: float) -> dict:
    """One recipe at one seed: its learning numbers, or why there are none."""
    load, t0 = os.getloadavg()[0], time.time()
    with tempfile.TemporaryDirectory(prefix="mgrpo-learning-") as tmp:
        try:
            got = RUNNERS[recipe.runner](recipe, seed, tmp, timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
            return {"error": str(e)[-800:], "wall_s": round(time.time() - t0, 1)}
    rewards = got.pop("rewards")
    return {"first10": round(sum(rewards[:10]) / max(1, min(10, len(rewards))), 4),
            "last10": round(sum(rewards[-10:]) / max(1, min(10, len(rewards))), 4), "steps": len(rewards),
            "wall_s": round(time.time() - t0, 1), "load_1m_at_start": round(load, 2), **got}


def summarise(name: str, runs: dict[str, dict]) -> dict:
    recipe = RECIPES[name]
    lasts = [r["last10"] for r in runs.values() if "last10" in r]
    out = {"seeds": runs, "floor": recipe.floor, "failed_runs": sum("error" in r for r in runs.values())}
    if lasts:
        out.update(min=min(lasts), median=round(statistics.median(lasts), 4), max=max(lasts),
                   under_floor=sum(x < recipe.floor for x in lasts) + sum(
                       r.get("letters_solved", recipe.min_letters or 0) < (recipe.min_letters or 0)
                       for r in runs.values() if "last10" in r and r["last10"] >= recipe.floor),
                   median_wall_s=round(statistics.median(r["wall_s"] for r in runs.values() if "last10" in r), 1))
    return out


def read_history(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def previous_for(history: list[dict], name: str) -> Optional[dict]:
    """The last line of the history that ran `name` (its summary, with the line's commit)."""
    for line in reversed(history):
        if line.get("overrides"):  # a candidate's line is not the recipe's
            continue
        got = line.get("recipes", {}).get(name)
        if got and "median" in got:
            return {**got, "commit": line["commit"]}
    return None


def regressions(history: list[dict], line: dict) -> list[str]:
    found = []
    for name, got in line["recipes"].items():
        recipe = RECIPES[name]
        if got["failed_runs"]:
            found.append(f"{name}: {got['failed_runs']} run(s) failed")
        if "median" not in got:
            continue
        allowed = len(got["seeds"]) - (recipe.min_passing or len(got["seeds"])) if recipe.min_passing else 0
        if got["under_floor"] > allowed:
            letters = f", or under {recipe.min_letters} of 26 letters" if recipe.min_letters else ""
            found.append(f"{name}: {got['under_floor']} of {len(got['seeds'])} seeds under the floor {recipe.floor}"
                         f"{letters} (min {got['min']})")
        before = previous_for(history, name)
        if before and got["median"] < before["median"] - 0.05:
            found.append(f"{name}: median last-10 {before['median']} -> {got['median']} (line {before['commit']})")
    return found


def latest(history: list[dict]) -> dict[str, dict]:
    """Per recipe, the newest commit's summary (with its commit and date). Lines of one commit that ran the same
    recipe (seeds run in separate invocations, e.g. the slow tier) count together; a later seed's run replaces an
    earlier one of the same seed."""
    out: dict[str, dict] = {}
    for line in history:
        if line.get("overrides"):
            continue
        for name, got in line.get("recipes", {}).items():
            if "median" not in got:
                continue
            seeds = got["seeds"]
            if name in out and out[name]["commit"] == line["commit"]:
                seeds = {**out[name]["seeds"], **seeds}
            out[name] = {**summarise(name, seeds), "commit": line["commit"], "date_utc": line["date_utc"]}
    return out


def table(history: list[dict]) -> str:
    """The learning table the docs show: per recipe the newest line's spread over seeds."""
    rows = ["| recipe | seeds | last-10 min / median / max | first-10 median | floor | median wall (load) | line |",
            "|---|---|---|---|---|---|---|"]
    for name, got in latest(history).items():
        firsts = [r["first10"] for r in got["seeds"].values() if "first10" in r]
        loads = [r["load_1m_at_start"] for r in got["seeds"].values() if "load_1m_at_start" in r]
        letters = [r["letters_solved"] for r in got["seeds"].values() if "letters_solved" in r]
        spread = f"{got['min']:.3f} / {got['median']:.3f} / {got['max']:.3f}" + (
            f" ({min(letters)}-{max(letters)} of 26 letters)" if letters else "")
        floor = f"{got['floor']}" + (f", {RECIPES[name].min_letters} letters" if letters else "")
        rows.append(f"| {RECIPES[name].what if name in RECIPES else name} | {len(got['seeds'])} | {spread} | "
                    f"{statistics.median(firsts):.3f} | {floor} | "
                    f"{got['median_wall_s']:.0f} s ({min(loads):.0f}-{max(loads):.0f}) | {got['commit']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=None, help=f"comma list of {', '.join(RECIPES)}")
    ap.add_argument("--tier", choices=("fast", "slow", "all"), default="fast",
                    help="which recipes when --recipes is not given")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for one run")
    ap.add_argument("--fail-on-regression", action="store_true")
    ap.add_argument("--show", action="store_true", help="print the table of the history and exit")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every run (after --): a candidate")
    add_output_args(ap, "learning_history.jsonl")
    args = ap.parse_args(argv)
    EXTRA[:] = args.overrides
    path = output_path(args, "learning_history.jsonl")
    committed = read_history(os.path.join(REPO, "benchmarks", "results", "learning_history.jsonl"))
    if args.show:
        print(table(read_history(path) or committed))
        return 0
    names = args.recipes.split(",") if args.recipes else [
        n for n, r in RECIPES.items() if args.tier == "all" or r.slow == (args.tier == "slow")]
    unknown = set(names) - set(RECIPES)
    if unknown:
        ap.error(f"unknown recipes {sorted(unknown)}; known: {', '.join(RECIPES)}")
    commit, dirty = checkout_state()
    line = {"commit": commit, "modified_tracked_files": dirty,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m benchmarks.tools.learning_history " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:]),
            "overrides": args.overrides, "machine": machine(packages=("torch", "ray", "megatron-core", "transformers")), "recipes": {}}
    for name in names:
        runs = {}
        for seed in args.seeds:
            runs[str(seed)] = got = run_one(RECIPES[name], seed, args.timeout)
            print(f"{name} seed {seed}: " + (f"first-10 {got['first10']:.3f}, last-10 {got['last10']:.3f}, "
                                              f"{got['steps']} steps, {got['wall_s']:.0f} s, load "
                                              f"{got['load_1m_at_start']}" if "last10" in got else
                                              f"FAILED {got['error'][-300:]}"), flush=True)
        line["recipes"][name] = summarise(name, runs)
        line["recipes"][name]["recipe_overrides"] = list(RECIPES[name].overrides)  # a recipe may change later
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"appended to {path}\n" + table([{**line, "overrides": []}]))
    found = regressions(committed, line)
    if found:
        bar = "!" * 100
        print(f"\n{bar}\nREGRESSION:\n  " + "\n  ".join(found) + f"\n{bar}", flush=True)
    return 1 if found and args.fail_on_regression else 0


if __name__ == "__main__":
    sys.exit(main())
