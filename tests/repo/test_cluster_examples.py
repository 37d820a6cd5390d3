"""Every cluster example the docs ship fits: each `mgrpo-train`, `mgrpo-plan` and `sbatch slurm/train.sbatch` command
in README.md, docs/*.md, slurm/README.md, the sbatch header and the recipes' headers that runs on GPUs is planned
here as mgrpo-plan plans it (FITS on the GPUs it names, every GPU generating), and the training commands name a
model path and train on GSM8K, not the synthetic task. The commands are read from the files, so an example that
changes is checked as it reads."""

from __future__ import annotations

import re
import shlex

import pytest

from mgrpo.compat.verl import translate
from mgrpo_launchers.plan import build_plan, compose_config, render
from tests.helpers import ROOT


SOURCES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
           "slurm/README.md", "slurm/train.sbatch", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "configs" / "recipe").glob("*.yaml"))]
COMMAND = re.compile(r"(?P<sbatch>\bsbatch(?P<opts>(?:\s+--[\w-]+=\S+)*)\s+slurm/train\.sbatch\b)|(?<![\w-])mgrpo-(?P<tool>train|plan)(?=\s|$)")


def sbatch_header() -> dict:
    text = (ROOT / "slurm" / "train.sbatch").read_text()
    return {k: v for k, v in re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M)}


def commands() -> list[tuple[str, str, list[str], dict]]:
    """(where, tool, overrides, sbatch options) of every complete command in the sources (no '<...>' or '...')."""
    out = []
    for rel in SOURCES:
        text = (ROOT / rel).read_text().replace("\\\n", " ")
        for n, line in enumerate(text.splitlines(), start=1):
            line = re.sub(r"^\s*#\s?", "", line)  # a YAML or shell comment holds the example
            for m in COMMAND.finditer(line):
                rest = line[m.end():].split("`")[0].split(" #")[0]
                if "<" in rest or "..." in rest:
                    continue  # a pattern, not a command
                try:
                    tokens = shlex.split(rest)
                except ValueError:
                    continue
                overrides = [t for t in tokens if "=" in t and not t.startswith("-")]
                opts = dict(re.findall(r"--([\w-]+)=(\S+)", m.group("opts") or ""))
                out.append((f"{rel}:{n}", "sbatch" if m.group("sbatch") else m.group("tool"), overrides, opts))
    return out


def on_gpus(tool: str, overrides: list[str], opts: dict) -> list[str] | None:
    """The overrides mgrpo-train runs with (for sbatch: what slurm/train.sbatch adds in front), or None for a
    command that does not run on GPUs."""
    if tool == "sbatch":
        if not overrides:
            return None  # `sbatch slurm/train.sbatch` named in prose, not an example to run
        header = {**sbatch_header(), **opts}
        if header.get("gpus-per-node") == "0":
            return None  # the local one-node SLURM of the tests (slurm/README.md, "Testing")
        overrides = [f"trainer.nnodes={header['nodes']}", f"trainer.n_gpus_per_node={header['gpus-per-node']}",
                     "trainer.device=cuda", *overrides]
    if translate(overrides).is_verl:
        return None  # a veRL line takes veRL's GPU defaults; tests/compat/test_verl_scripts.py runs veRL's own scripts
    return overrides if planned(overrides).trainer.device == "cuda" else None


def planned(overrides: list[str]):
    """The config mgrpo-plan plans for these overrides (veRL keys translated), without the model path: the
    placeholder has no config.json, and the plan needs none."""
    args = [a for a in translate([o for o in overrides if not o.startswith("model.hf_path=")]).args if "=" in a]
    return compose_config(args)


CLUSTER = [(where, tool, full) for where, tool, o, opts in commands() if (full := on_gpus(tool, o, opts)) is not None]


def test_the_examples_are_found():
    """The extraction sees the examples this test is about (a reworded README must not empty it)."""
    where = {w.split(":")[0] for w, _, _ in CLUSTER}
    assert {"README.md", "docs/scale-and-planning.md", "slurm/README.md", "slurm/train.sbatch",
            "configs/recipe/qwen3-8b-gsm8k-grpo.yaml",
            "configs/recipe/qwen3-8b-dapo.yaml", "configs/recipe/qwen3-8b-dr-grpo.yaml"} <= where
    assert sum(tool == "sbatch" for _, tool, _ in CLUSTER) >= 5 and len(CLUSTER) >= 12


@pytest.mark.parametrize("where, tool, overrides", CLUSTER, ids=[w for w, _, _ in CLUSTER])
def test_cluster_example_fits_and_trains_what_it_says(where, tool, overrides):
    cfg = planned(overrides)
    plan = build_plan(cfg)
    text = render(plan)
    gpus, ro = plan["gpus"], plan["rollout"]
    print(f"{where}: {tool} {' '.join(overrides)}\n  {gpus['total']} GPUs: {gpus['training']} train, "
          f"{ro['num_engines']} engine(s) x tp {ro['tp']} = {gpus['generation']} generate; "
          f"{plan['memory_per_accelerator']['verdict']}")
    assert plan["memory_per_accelerator"]["fits"], f"{where}: {plan['memory_per_accelerator']['verdict']}"
    assert f"GPUs      {gpus['training']} of {gpus['total']} train" in text
    assert gpus["training"] == gpus["total"] and gpus["generation"] == gpus["total"], f"{where}: idle GPUs"
    if tool != "plan":  # it trains: a real checkpoint and GSM8K
        path = [o.split("=", 1)[1] for o in overrides if o.startswith("model.hf_path=")]
        assert path and path[0].startswith("/") and path[0].rstrip("/").split("/")[-1].startswith("Qwen3-"), \
            f"{where}: names no model path (model.hf_path=/path/to/Qwen3-...)"
        assert cfg.data.train_files and all("gsm8k" in f for f in cfg.data.train_files), \
            f"{where}: trains on {cfg.data.train_files or 'the synthetic task'}, not GSM8K"
