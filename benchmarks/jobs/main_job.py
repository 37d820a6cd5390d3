"""The README's main job, measured: wall time, peak memory of the whole process tree (driver, Ray's
processes, Megatron ranks, rollout engine, reward workers) and the learning numbers it must show.

    python -m benchmarks.jobs.main_job                # mgrpo-train with its defaults
    python -m benchmarks.jobs.main_job -- actor.tp=2  # extra Hydra overrides after --

Writes benchmarks/results/main_job_cpu.json (or --out) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import TreeMonitor, machine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap, "main_job_cpu.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for mgrpo-train (after --)")
    args = ap.parse_args(argv)
    args.out = output_path(args, "main_job_cpu.json")

    run_dir = tempfile.mkdtemp(prefix="mgrpo-main-job-")
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", *args.overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    monitor = TreeMonitor(proc.pid)
    monitor.start()
    first_step_at = None
    tail: list[str] = []
    for line in proc.stdout:
        if line.startswith("step "):
            first_step_at = first_step_at or time.time() - t0
            print(line, end="", flush=True)
        tail = (tail + [line])[-40:]
    rc = proc.wait()
    wall = time.time() - t0
    monitor.stop()
    if rc != 0:
        sys.exit(f"mgrpo-train exited {rc}:\n" + "".join(tail))

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "critic/score/mean" in m]
    rewards = [m["critic/score/mean"] for m in steps]
    step_times = sorted(m["timing_s/step"] for m in steps)
    result = {
        "command": "mgrpo-train " + " ".join(args.overrides),
        "steps": len(steps),
        "reward_first10": sum(rewards[:10]) / min(10, len(rewards)),
        "reward_last10": sum(rewards[-10:]) / min(10, len(rewards)),
        "wall_s": wall,
        "time_to_first_step_s": first_step_at,
        "median_step_s": step_times[len(step_times) // 2],
        "logprob_abs_diff_step1": steps[0]["rollout/logprob_abs_diff"],
        "ppo_kl_step1": steps[0]["actor/ppo_kl"],
        **monitor.summary(),
        "machine": machine(packages=("torch", "ray", "megatron-core", "transformers")),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"\n{result['command']}: {result['steps']} steps, mean reward first 10 {result['reward_first10']:.3f}, "
          f"last 10 {result['reward_last10']:.3f}; wall {wall:.0f} s (first step after "
          f"{first_step_at:.0f} s, median step {result['median_step_s']:.2f} s); peak memory of the process tree "
          f"{result['peak_pss_tree_mib']:.0f} MiB PSS / {result['peak_rss_tree_mib']:.0f} MiB RSS "
          f"({result['max_processes']} processes)\nwrote {args.out}")


if __name__ == "__main__":
    main()
