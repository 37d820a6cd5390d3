"""The docs' "Bring your own task" (docs/data-and-rewards.md), followed as a user would: its bash block, as
written, in an empty folder (a JSONL data file, a reward .py file given on the mgrpo-train command line as
`reward.custom_functions={src: file.py:fn}`, the printable tokenizer on the tiny model), and the run must learn a
task nothing was tuned on."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "data-and-rewards.md"


def recipe() -> str:
    block = re.search(r"<!-- recipe:own-task -->\n```bash\n(.*?)```\n<!-- /recipe:own-task -->", PAGE.read_text(),
                      re.S)
    assert block, "docs/data-and-rewards.md lost its '<!-- recipe:own-task -->' block"
    return block.group(1)


@pytest.mark.system
def test_readme_own_task_recipe_learns(tmp_path):
    """Chance is about 1/107 per character; first-10 mean reward <= 0.1, and the recipe's promise in the learning
    history (`RECIPES["own-task"]`): last-10 over its floor and its letters answered."""
    from benchmarks.tools.learning_history import RECIPES

    promise = RECIPES["own-task"]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe()], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "mgrpo" / "upper"
    with open(run_dir / "metrics.jsonl") as f:
        rewards = [json.loads(line)["critic/score/mean"] for line in f]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == 150 and first <= 0.1 and last >= promise.floor, (first, last)
    done = [line for line in out.stderr.splitlines() if "done | 150 steps" in line]
    assert done and f"reward first-10 {first:.3f}, last-10 {last:.3f}" in done[0], out.stderr[-2000:]
    # Which letters are answered, over the last 10 steps (320 prompts: every letter of the 26 many times). A
    # letter that settled on another answer before its capital was ever sampled stays unsolved.
    trajectories = [json.loads(line) for line in open(run_dir / "trajectories.jsonl")]
    solved = {(t["prompt"], t["response"]) for t in trajectories if t["step"] > 140 and t["reward"] == 1.0}
    assert all(r == p[0].upper() for p, r in solved), solved
    assert len({p for p, _ in solved}) >= promise.min_letters, sorted(solved)
