"""mgrpo's benchmarks: every script runs from the repository root as `python -m benchmarks.<folder>.<name>`
and writes its numbers, with the machine they came from, under `outputs/benchmarks/` (untracked); with
`--update-results` it writes the committed files under `benchmarks/results/` that the READMEs are rendered from
(see benchmarks/README.md), so a trial run never changes them.

    measure/  mgrpo's own costs: weight streaming and sync, packing, the planner against measured memory, a
              Megatron rank's memory call by call, the decode loop's heap, the engines' log-prob memory
    peers/    mgrpo against others on one workload: TRL's GRPOTrainer (grpo_vs_trl, scaling), the fused kernel
              against full logits and Liger (kernel_bench); grpo_workloads holds the workloads both sides run
    jobs/     the training job itself, run end to end: the main job, seeds, rollout paths, log-prob supports,
              the doctor on the main job, the chaos soak
    tools/    what the others share or feed: proctree (process-tree memory, the machine's description),
              readme_table (renders the docs' numbers from results/), test_suite (the suite's counts)
    gpu/      every GPU check in one command (`python -m benchmarks.gpu.run`), with a CPU dry run
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root (this package's parent folder)."""
RESULTS = os.path.join(REPO, "benchmarks", "results")
"""Where committed results live: benchmarks/results/."""
OUTPUTS = os.path.join(REPO, "outputs", "benchmarks")
"""Where a run writes unless told to update the committed results: outputs/benchmarks/ (untracked)."""


def add_output_args(parser, name: str, flag: str = "--out") -> None:
    """`flag` (default: outputs/benchmarks/<name>) and `--update-results` (default: benchmarks/results/<name>)."""
    parser.add_argument(flag, default=None, help=f"output path (default outputs/benchmarks/{name}, untracked; "
                                                 f"benchmarks/results/{name} with --update-results)")
    parser.add_argument("--update-results", action="store_true",
                        help="write the committed results under benchmarks/results/ (what the READMEs show)")


def output_path(args, name: str, flag: str = "out", folder: bool = False) -> str:
    """Where this run writes: the flag's value, else benchmarks/results/<name> with --update-results, else
    outputs/benchmarks/<name>. The path's folder (or the path itself, for a `folder`) is created."""
    path = getattr(args, flag) or os.path.join(RESULTS if args.update_results else OUTPUTS, name)
    os.makedirs(path if folder else os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(args, name: str, result: dict) -> str:
    """`result` as <output_path(args, name)>.json (indented), said on stdout; the path."""
    import json

    path = output_path(args, name) + ".json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    return path


def pyplot_or_say(path: str):
    """matplotlib's pyplot (the `bench` extra: pip install -e '.[bench]'), or None with a line saying that `path` is
    not drawn: a job run with the README's install keeps its numbers and ends well without the plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot {path}: matplotlib is not installed (pip install -c constraints.txt -e '.[bench]'); "
              "the numbers are in the JSON", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def add_work_args(parser, name: str) -> None:
    """`--work` (default outputs/<name>/): where a job writes what it makes (models, run folders) and keeps it."""
    parser.add_argument("--work", default=os.path.join(REPO, "outputs", name),
                        help=f"where the job's models and run folder are written and kept (default outputs/{name}/)")


def fresh_work(args) -> str:
    """`args.work` emptied of the previous run's files (mgrpo-train refuses a folder holding another run) and made;
    its absolute path. Nothing removes it afterwards, whether the job ends well or not."""
    import shutil

    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    return work


def checkout_state() -> tuple[str, list[str]]:
    """The checkout a history line measures: HEAD's short commit and the tracked files modified beside it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60).stdout

    modified = git("status", "--porcelain", "--untracked-files=no").splitlines()
    return git("rev-parse", "--short=10", "HEAD").strip(), modified
