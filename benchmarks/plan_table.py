"""The planner's verdict for Qwen3-8B and Qwen3-32B on 1, 2 and 8 nodes of 8 x 80 GiB GPUs.

    python benchmarks/plan_table.py

Each row is `mgrpo-plan recipe=qwen3-8b-gsm8k-grpo [model=qwen3-32b] trainer.nnodes=N` (the recipe's batch,
sequence lengths, token budget, colocated SGLang at gpu_memory_utilization 0.6, actor.tp=2, no distributed
optimizer, no recompute) and the change the planner finds that fits. These are the planner's estimates
(mgrpo/cluster/memory_plan.py), not measurements: no GPU was used. Writes
benchmarks/results/plan_qwen3_8x80gb.{csv,json} and prints the README table.
"""

from __future__ import annotations

import csv
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 1024**3


def rows() -> list[dict]:
    from mgrpo.cluster.memory_plan import LABELS
    from mgrpo_launchers.plan import build_plan, compose_config

    out = []
    for model in ("qwen3-8b", "qwen3-32b"):
        for nodes in (1, 2, 8):
            overrides = ["recipe=qwen3-8b-gsm8k-grpo", f"model={model}", f"trainer.nnodes={nodes}"]
            mem = build_plan(compose_config(overrides))["memory_per_accelerator"]
            row = {"model": model, "nodes": nodes, "gpus": 8 * nodes, "overrides": " ".join(overrides),
                   "peak_gib": round(mem["peak"] / GIB, 1), "peak_phase": mem["peak_phase"], "fits": mem["fits"],
                   "largest_term": LABELS[mem["largest_term"][0]],
                   "largest_term_gib": round(mem["largest_term"][1] / GIB, 1),
                   "suggestion": " ".join(mem["suggestion"] or []),
                   "suggested_peak_gib": round(mem["suggested_peak"] / GIB, 1) if mem["suggested_peak"] else None}
            out.append(row)
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


def main() -> None:
    table = rows()
    out = os.path.join(REPO, "benchmarks", "results", "plan_qwen3_8x80gb")
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    with open(out + ".json", "w") as f:
        json.dump({"command": "python benchmarks/plan_table.py", "gpu_memory_gib": 80,
                   "note": "planner estimates (mgrpo/cluster/memory_plan.py), not measurements", "rows": table},
                  f, indent=1)
    print(markdown(table))


if __name__ == "__main__":
    main()
