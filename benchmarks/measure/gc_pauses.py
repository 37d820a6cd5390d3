"""What Python's cycle collector costs the driver, with and without `trainer.gc_freeze` (mgrpo/observe/gc_pauses.py).

    python -m benchmarks.measure.gc_pauses                  # writes outputs/benchmarks/gc_pauses_cpu.json
    python -m benchmarks.measure.gc_pauses --steps 60 --update-results

The tiny workload's job (rollout=hf_cpu, 32 prompts x 8, 4 new tokens: `grpo_vs_trl`'s tiny) runs --steps steps
with trainer.gc_freeze=false, then =true: the driver's full collections and pause seconds during the steps (the step
metrics perf/gc_full_collections and perf/gc_pause_s) and the step time's median, mean and maximum (timing_s/step),
the first --skip steps left out. (What a full collection walks: the tiny job's driver tracked ~488,000 objects
mid-run (14 s after its start), 98k functions, 86k tuples, 51k dicts, nearly all made by its imports.)
Prints the table and writes JSON. It asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, write_json
from benchmarks.tools.proctree import machine

TINY = ["rollout=hf_cpu", "data.train_batch_size=32", "rollout.n=8", "data.max_response_length=4",
        "data.max_prompt_length=32", "trainer.save_freq=0", "trainer.save_hf=false", "trainer.resume=disable"]


def run_job(freeze: bool, steps: int, skip: int, workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"freeze_{str(freeze).lower()}")
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}",
           f"trainer.total_training_steps={steps}", f"trainer.gc_freeze={str(freeze).lower()}", *TINY]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"gc_pauses: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "timing_s/step" in r][skip:]
    step_ms = [r["timing_s/step"] * 1e3 for r in rows]
    return {"gc_freeze": freeze, "steps_counted": len(rows), "wall_s": round(time.time() - t0, 1),
            "driver_full_collections": int(sum(r["perf/gc_full_collections"] for r in rows)),
            "driver_gc_pause_s": round(sum(r["perf/gc_pause_s"] for r in rows), 4),
            "driver_gc_pause_max_step_s": round(max(r["perf/gc_pause_s"] for r in rows), 4),
            "step_median_ms": round(statistics.median(step_ms), 1), "step_mean_ms": round(statistics.mean(step_ms), 1),
            "step_max_ms": round(max(step_ms), 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the step times (warm-up)")
    add_output_args(ap, "gc_pauses_cpu")
    a = ap.parse_args(argv)
    out = {"machine": machine(packages=("torch", "ray")),
           "command": "python -m benchmarks.measure.gc_pauses " + " ".join(argv or sys.argv[1:]),
           "runs": []}
    with tempfile.TemporaryDirectory(prefix="mgrpo-gc-") as tmp:
        for freeze in (False, True):
            r = run_job(freeze, a.steps, a.skip, tmp)
            out["runs"].append(r)
            print(" ".join(f"{k}={v}" for k, v in r.items()))
    write_json(a, "gc_pauses_cpu", out)


if __name__ == "__main__":
    main()
