"""The main job through each rollout path, one after another in one run: learning, step time and
generation time of the in-process engine vs the SGLang protocol path (colocated, disaggregated, two
engines behind SGLang's router), and synchronous vs one-step-off asynchronous rollout.

    python -m benchmarks.jobs.rollout_paths               # every variant, 150 steps each
    python -m benchmarks.jobs.rollout_paths --only async  # variants whose name contains 'async'
    python -m benchmarks.jobs.rollout_paths --pin         # Megatron rank on core 0, engine on core 1

With --pin the Megatron rank's and the engine's processes (found by their Ray process titles and the
CPU server's command line) are given one core each, so that overlapping generation with training has
the cores to overlap on. Writes benchmarks/results/rollout_paths_cpu.{json,csv}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import machine

DISAGG = ("rollout.mode=disaggregated", "trainer.n_gpus_per_node=2")
VARIANTS = {
    "hf-inprocess": ("rollout=hf_cpu",),
    "sglang-colocated": ("rollout.engine=sglang",),
    "sglang-disaggregated": ("rollout.engine=sglang", *DISAGG),
    "sglang-router-2-engines": ("rollout.engine=sglang", "rollout.num_engines=2", "trainer.n_gpus_per_node=2"),
    "sync-disaggregated": DISAGG,
    "async-one-step-off": (*DISAGG, "rollout.async_mode=one_step_off"),
}


def pin_processes(stop: threading.Event) -> None:
    """Core 0 for Megatron ranks, core 1 for engines (their hosts and servers)."""
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                if "MegatronRank" in cmd:
                    os.sched_setaffinity(int(pid), {0})
                elif "EngineHost" in cmd or "sglang.cpu.server" in cmd:
                    os.sched_setaffinity(int(pid), {1})
            except OSError:
                continue
        stop.wait(1.0)


def run(name: str, overrides: tuple, steps: int, pin: bool) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"mgrpo-{name}-")
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", "trainer.save_hf=false",
           f"trainer.total_training_steps={steps}", *overrides]
    stop = threading.Event()
    if pin:
        threading.Thread(target=pin_processes, args=(stop,), daemon=True).start()
    t0 = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    stop.set()
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f]
    rewards = [x["critic/score/mean"] for x in m]
    resp_tokens = sum(x["response_length/mean"] * x["rollout/samples"] for x in m)
    train_s = sum(x["timing_s/step"] for x in m)
    return {"variant": name, "overrides": " ".join(overrides), "steps": len(m),
            "reward_first10": sum(rewards[:10]) / 10, "reward_last10": sum(rewards[-10:]) / 10,
            "median_step_s": statistics.median(x["timing_s/step"] for x in m),
            "median_gen_s": statistics.median(x.get("timing_s/gen", 0.0) for x in m),
            "median_rollout_wait_s": statistics.median(x["timing_s/rollout"] for x in m),
            "response_tokens_per_s": resp_tokens / train_s, "wall_s": time.time() - t0,
            "logprob_abs_diff_step1": m[0]["rollout/logprob_abs_diff"], "pinned": pin}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--only", default="")
    ap.add_argument("--pin", action="store_true")
    add_output_args(ap, "rollout_paths_cpu")
    args = ap.parse_args()
    args.out = output_path(args, "rollout_paths_cpu")
    rows = []
    for name, overrides in VARIANTS.items():
        if args.only in name:
            rows.append(run(name, overrides, args.steps, args.pin))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": rows, "load_avg_at_end": os.getloadavg(),
                   "machine": machine(packages=("torch", "ray", "megatron-core", "transformers"))}, f, indent=1)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}.json/.csv")


if __name__ == "__main__":
    main()
