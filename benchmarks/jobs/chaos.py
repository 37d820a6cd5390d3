"""Chaos soak (the harness is tests/helpers/chaos.py, beside the system test that runs it in short): one long run with a seeded schedule of faults of every kind, healed in the run or survived by
resuming (as a SLURM requeue would), and at the end the same records and the same final weights as the run
without faults.

    python -m benchmarks.jobs.chaos                     # both jobs, 200 steps, 12 faults each
    python -m benchmarks.jobs.chaos --job default --steps 20 --faults 3 --kinds engine_kill,router_kill,driver_kill

Per job, the harness first runs the job once without faults (the reference), then again under the schedule.
A fault fires once the run's console has shown step `at_step` (of the attempt running), `delay_s` later
(`delay_s` < 1, scaled by the last step's duration where a step takes less than a second):

| kind | what | expected |
|---|---|---|
| engine_kill | SIGKILL one engine's server | healed: restarted, re-synced, its requests resent (`rollout/restarts`) |
| engine_hang | SIGSTOP one engine's server | healed: its health check times out, then as above |
| router_kill | SIGKILL SGLang's router (2 engines) | healed: a new router in front of the engines (`rollout/restarts`) |
| reward_worker_kill | SIGKILL a reward worker | healed: replaced, its call sent again (`reward/worker_restarts`) |
| megatron_rank_kill | SIGKILL a Megatron rank | fatal: the run fails naming the rank and its pid; resumed |
| driver_kill | SIGKILL the driver | fatal (nothing is said); the job's processes are killed; resumed |
| preempt | SIGTERM the driver (SLURM preemption) | the step finishes, a checkpoint, exit 75; resumed |

Processes are found by what belongs to this run only: the CPU servers by their model folder
(<run>/init_hf), every other process by the run's private RAY_TMPDIR in its environment (each attempt has
its own), reward workers also by their parent (the driver). A resumed attempt runs with
`trainer.resume=auto`, exactly as slurm/train.sbatch does after a requeue.

Checked at the end and written to --out (benchmarks/results/chaos_cpu.json): every step exactly once in
metrics.jsonl, TensorBoard and trajectories.jsonl, every step's samples complete (each prompt n times),
every fault accounted for (in the harness's events and, for healed ones, in the run's counters), and the
final HF export against the reference run's (max abs difference; bit-exact or not).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from benchmarks import RESULTS
from benchmarks.tools.proctree import machine
from tests.helpers.chaos import JOBS, KINDS, soak_job


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=[*JOBS, "all"], default="all")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds (default: all)")
    ap.add_argument("--batch", type=int, default=32, help="data.train_batch_size (the default job's 32)")
    ap.add_argument("--n", type=int, default=8, help="rollout.n (the default job's 8)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "chaos_cpu.json"))
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (after --)")
    args = ap.parse_args(argv)
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
            result["jobs"][name] = r = soak_job(name, args.overrides, steps=args.steps, faults=args.faults,
                                                seed=args.seed, kinds=kinds, batch=args.batch, n=args.n,
                                                workdir=workdir)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            v = r["vs_uninterrupted"]
            print(f"\n{name}: {len(r['faults'])} faults of {len(r['fault_kinds'])} kinds survived in "
                  f"{len(r['attempts'])} attempts; records {r['records']}; final HF export vs the run without faults: "
                  f"max abs diff {v['hf_max_abs_diff']:g} ({'bit-exact' if v['hf_bit_exact'] else 'NOT bit-exact'}); "
                  f"wall {r['chaos_wall_s']:.0f} s (reference {r['reference_wall_s']} s)\nwrote {args.out}")
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
