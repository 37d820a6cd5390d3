"""The planner's verdict for Qwen3-8B and Qwen3-32B on 1, 2 and 8 nodes, and for Qwen3-30B-A3B (MoE) on
1, 2 and 4 nodes, of 8 x 80 GiB GPUs.

    python -m benchmarks.measure.plan_table                   # prints the tables; writes outputs/benchmarks/
    python -m benchmarks.measure.plan_table --update-results  # also replaces benchmarks/results/plan_qwen3_*8x80gb.*

Each row is `mgrpo-plan recipe=qwen3-8b-gsm8k-grpo [model=...] trainer.nnodes=N` (the recipe as it ships: its
batch, sequence lengths, token budget, parallel layout, colocated SGLang share; Qwen3-30B-A3B at actor.tp=4,
the most its 4 key/value heads allow, and expert-parallel size 1) and the change the planner finds that fits
(its knobs include actor.ep for a MoE model). These are the planner's estimates (mgrpo/plan/memory.py),
not measurements: no GPU was used. Writes plan_qwen3_8x80gb.{csv,json} and plan_qwen3_moe_8x80gb.{csv,json}
to --out (default outputs/benchmarks/, untracked); the committed copies under benchmarks/results/ (what the
README's tables are rendered from, benchmarks/tools/readme_table.py) change only with --update-results.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from benchmarks import add_output_args, output_path

GIB = 1024**3


DENSE = [(model, nodes, []) for model in ("qwen3-8b", "qwen3-32b") for nodes in (1, 2, 8)]
MOE = [("qwen3-30b-a3b", nodes, ["actor.tp=4"]) for nodes in (1, 2, 4)]


def rows(cases=DENSE) -> list[dict]:
    from mgrpo.plan.memory import LABELS
    from mgrpo_launchers.plan import build_plan, compose_config

    out = []
    for model, nodes, extra in cases:
        overrides = ["recipe=qwen3-8b-gsm8k-grpo", f"model={model}", *extra, f"trainer.nnodes={nodes}"]
        mem = build_plan(compose_config(overrides))["memory_per_accelerator"]
        out.append({"model": model, "nodes": nodes, "gpus": 8 * nodes, "overrides": " ".join(overrides),
                    "peak_gib": round(mem["peak"] / GIB, 1), "peak_phase": mem["peak_phase"], "fits": mem["fits"],
                    "largest_term": LABELS[mem["largest_term"][0]],
                    "largest_term_gib": round(mem["largest_term"][1] / GIB, 1),
                    "suggestion": " ".join(mem["suggestion"] or []),
                    "suggested_peak_gib": round(mem["suggested_peak"] / GIB, 1) if mem["suggested_peak"] else None})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| model | nodes x 8 GPUs | peak per GPU (recipe) | verdict | largest term | change that fits (peak) |",
             "|---|---|---|---|---|---|"]
    for r in table:
        fix = f"`{r['suggestion']}` ({r['suggested_peak_gib']} GiB)" if r["suggestion"] else \
            ("none needed" if r["fits"] else "none within 4 knob changes: more GPUs needed")
        lines.append(f"| {r['model']} | {r['nodes']} | {r['peak_gib']} GiB ({r['peak_phase']}) | "
                     f"{'FITS' if r['fits'] else 'DOES NOT FIT'} | {r['largest_term']} {r['largest_term_gib']} GiB | "
                     f"{fix} |")
    return "\n".join(lines)


def recipe_settings() -> dict:
    """What the recipe ships with that decides its memory (docs/scale-and-planning.md says it beside the table)."""
    from mgrpo_launchers.plan import compose_config

    cfg = compose_config(["recipe=qwen3-8b-gsm8k-grpo"])
    a, r = cfg.actor, cfg.rollout
    return {"actor.tp": a.tp, "actor.pp": a.pp, "actor.max_tokens_per_gpu": a.max_tokens_per_gpu,
            "actor.recompute": a.recompute, "actor.use_distributed_optimizer": a.use_distributed_optimizer,
            "rollout.mode": r.mode, "rollout.gpu_memory_utilization": r.gpu_memory_utilization}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap, "")  # a folder: plan_qwen3_8x80gb.*, plan_qwen3_moe_8x80gb.*
    args = ap.parse_args(argv)
    folder = output_path(args, "", folder=True)
    for cases, name in ((DENSE, "plan_qwen3_8x80gb"), (MOE, "plan_qwen3_moe_8x80gb")):
        table = rows(cases)
        out = os.path.join(folder, name)
        with open(out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
        with open(out + ".json", "w") as f:
            json.dump({"command": "python -m benchmarks.measure.plan_table --update-results", "gpu_memory_gib": 80,
                       "note": "planner estimates (mgrpo/plan/memory.py), not measurements",
                       "recipe": recipe_settings(), "rows": table}, f, indent=1)
        print(markdown(table) + "\n")
        print(f"wrote {out}.csv and .json", file=sys.stderr)


if __name__ == "__main__":
    main()
