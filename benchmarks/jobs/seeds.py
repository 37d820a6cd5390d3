"""The main job under other seeds: does it learn whatever the seed? Runs benchmarks/jobs/main_job.py once per
seed (trainer.seed, data.seed and actor.seed all set to it) and writes benchmarks/results/seeds_cpu.json (or
--out): per seed the mean reward over the first and last 10 steps, wall time and the machine's load.

    python -m benchmarks.jobs.seeds           # seeds 1 2 3, the default 150 steps
    python -m benchmarks.jobs.seeds --seeds 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import machine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    add_output_args(ap, "seeds_cpu.json")
    args = ap.parse_args(argv)
    args.out = output_path(args, "seeds_cpu.json")
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "run.json")
            overrides = [f"trainer.seed={seed}", f"data.seed={seed}", f"actor.seed={seed}"]
            load = os.getloadavg()[0]
            subprocess.run([sys.executable, "-m", "benchmarks.jobs.main_job", "--out", out, "--",
                            *overrides], check=True, cwd=REPO)
            with open(out) as f:
                run = json.load(f)
        rows.append({"seed": seed, "command": run["command"], "steps": run["steps"],
                     "reward_first10": run["reward_first10"], "reward_last10": run["reward_last10"],
                     "wall_s": run["wall_s"], "load_1m_at_start": load, "load_1m_at_end": os.getloadavg()[0]})
    command = "python -m benchmarks.jobs.seeds" + ("" if args.seeds == [1, 2, 3] else
                                              " --seeds " + " ".join(map(str, args.seeds)))
    result = {"command": command, "rows": rows,
              "machine": machine(packages=("torch", "ray", "megatron-core", "transformers"))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"seed {r['seed']}: {r['steps']} steps, mean reward first 10 {r['reward_first10']:.3f}, last 10 "
              f"{r['reward_last10']:.3f}, {r['wall_s']:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
