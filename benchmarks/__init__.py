"""mgrpo's benchmarks: every script runs from the repository root as `python -m benchmarks.<folder>.<name>`
and writes its numbers, with the machine they came from, under `benchmarks/results/` (see README.md here).

    measure/  mgrpo's own costs: weight streaming and sync, packing, the planner against measured memory, a
              Megatron rank's memory call by call, the decode loop's heap, the engines' log-prob memory
    peers/    mgrpo against others on one workload: TRL's GRPOTrainer (grpo_vs_trl, scaling), the fused kernel
              against full logits and Liger (kernel_bench); grpo_workloads holds the workloads both sides run
    jobs/     the training job itself, run end to end: the main job, seeds, rollout paths, log-prob supports,
              the doctor on the main job, the chaos soak
    tools/    what the others share or feed: proctree (process-tree memory, the machine's description),
              readme_table (renders the README's numbers from results/), test_suite (the suite's counts)
    gpu/      every GPU check in one command (`python -m benchmarks.gpu.run`), with a CPU dry run
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root (this package's parent folder)."""
RESULTS = os.path.join(REPO, "benchmarks", "results")
"""Where committed results live: benchmarks/results/."""
