"""Chaos soak: one long run with a seeded schedule of faults of every kind, healed in the run or survived by
resuming (as a SLURM requeue would), and at the end the same records and the same final weights as the run
without faults. The harness, its fault kinds and what each is expected to do are in tests/helpers/chaos.py,
beside tests/e2e/test_chaos.py, which runs it in short; this is its command line and results writer.

    python -m benchmarks.jobs.chaos                     # every job, 200 steps, 12 faults each (of the kinds it has)
    python -m benchmarks.jobs.chaos --job default --steps 20 --faults 3 --kinds engine_kill,router_kill,driver_kill
    python -m benchmarks.jobs.chaos --job reward_model --steps 12 --faults 1 --kinds judge_kill --batch 8 --n 4
    python -m benchmarks.jobs.chaos --job multi_turn --steps 30 --faults 6 --batch 4 --n 4

Each job takes the kinds that have a target in it: judge_kill only in the reward_model job; tool_hang and
env_crash only in the multi_turn job, whose tool and environment are the user's file (no server or router kills
there).

Writes --out (benchmarks/results/chaos_cpu.json): per job, every step once in metrics.jsonl, TensorBoard and
trajectories.jsonl, every fault accounted for, and the final HF export against the reference run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from benchmarks import add_output_args, output_path
from benchmarks.tools.proctree import machine
from tests.helpers.chaos import JOBS, KINDS, job_kinds, soak_job


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=[*JOBS, "all"], default="all")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds (default: all)")
    ap.add_argument("--batch", type=int, default=32, help="data.train_batch_size (the default job's 32)")
    ap.add_argument("--n", type=int, default=8, help="rollout.n (the default job's 8)")
    add_output_args(ap, "chaos_cpu.json")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (after --)")
    args = ap.parse_args(argv)
    args.out = output_path(args, "chaos_cpu.json")
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; known: {list(KINDS)}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="mgrpo-chaos-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    result = {"machine": machine(packages=("torch", "ray", "megatron-core", "transformers")), "jobs": {}}
    if os.path.isfile(args.out):  # one job at a time keeps the other's result
        with open(args.out) as f:
            result["jobs"] = json.load(f).get("jobs", {})
    try:
        for name in (list(JOBS) if args.job == "all" else [args.job]):
            mine = job_kinds(name, kinds)  # the kinds that have a target in this job
            result["jobs"][name] = r = soak_job(name, args.overrides, steps=args.steps, faults=args.faults,
                                                seed=args.seed, kinds=mine, batch=args.batch, n=args.n,
                                                workdir=workdir)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            v = r["vs_uninterrupted"]
            print(f"\n{name}: {len(r['faults'])} faults of {len(r['fault_kinds'])} kinds survived in "
                  f"{len(r['attempts'])} attempts; records {r['records']}; final HF export vs the run without faults: "
                  f"max abs diff {v['hf_max_abs_diff']:g} ({'bit-exact' if v['hf_bit_exact'] else 'NOT bit-exact'}); "
                  f"wall {r['chaos_wall_s']:.0f} s (reference {r['reference_wall_s']} s)\nwrote {args.out}")
    except BaseException:
        print(f"kept for a look: {workdir}", file=sys.stderr)
        raise
    if args.workdir is None:  # everything is in the results: the temporary folder goes
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
