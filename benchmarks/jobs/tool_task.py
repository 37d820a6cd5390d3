"""The README's tool task (recipe=tool-peek-tiny-cpu), run as a user runs it, summarised for the README.

    python -m benchmarks.jobs.tool_task                    # runs it (minutes on 2 cores)
    python -m benchmarks.jobs.tool_task --from RUN_DIR     # summarises a finished run
-> benchmarks/results/tool_peek_cpu.json (per step: mean reward, tool calls per trajectory, the free call rate,
turns, tokens the grammar wrote), the README's plot benchmarks/results/tool_peek_cpu.png (reward, calls per
trajectory and the free call rate vs step) and the markdown table the README shows (every 10th step), printed.
The free call rate (multi_turn/free_call_rate): of the trajectories whose first turn was under tool_choice=auto
(not forced by rollout.multi_turn.required_per_group), the share that called: the policy's own choice.

The second stage: the call left to the policy (rollout.multi_turn.tool_choice=auto), from the first stage's
weights (its RUN_DIR/hf), so the call rate can rise once reading the reply pays:
    python -m benchmarks.jobs.tool_task --auto-from RUN_DIR [--from RUN_DIR2]
-> benchmarks/results/tool_peek_auto_cpu.json / .png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results", "tool_peek_cpu.json")
PLOT = os.path.join(os.path.dirname(__file__), "..", "results", "tool_peek_cpu.png")
AUTO_STEPS = 30
"""Steps of the second stage."""


def auto_overrides(stage1: str) -> list[str]:
    return [f"model.hf_path={os.path.join(stage1, 'hf')}", "rollout.multi_turn.tool_choice=auto",
            f"trainer.total_training_steps={AUTO_STEPS}"]


def summarise(run_dir: str, seconds: float | None, command: str = "mgrpo-train recipe=tool-peek-tiny-cpu") -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [{"step": i + 1, "reward": round(m["critic/score/mean"], 4),
              "tool_calls_per_trajectory": round(m.get("multi_turn/tool_calls_per_trajectory", 0.0), 4),
              # None: every first turn was forced (tool_choice=required), no call was the policy's choice
              "free_call_rate": (round(m["multi_turn/free_call_rate"], 4) if m.get("multi_turn/free_trajectories")
                                 else None),
              "free_trajectories": m.get("multi_turn/free_trajectories", 0),
              "turns": round(m.get("multi_turn/turns_mean", 0.0), 4),
              "constrained_tokens": m.get("multi_turn/constrained_tokens", 0),
              "step_s": round(m.get("timing_s/step", 0.0), 2)} for i, m in enumerate(rows)]
    r = [s["reward"] for s in steps]
    c = [s["tool_calls_per_trajectory"] for s in steps]
    f = [s["free_call_rate"] for s in steps if s["free_call_rate"] is not None]
    free = {"first10_free_call_rate": round(sum(f[:10]) / 10, 4), "last10_free_call_rate": round(sum(f[-10:]) / 10, 4)
            } if len(f) == len(steps) >= 10 else {}
    return {"command": command, "seconds": seconds, "chance": 0.1,
            "first10_reward": round(sum(r[:10]) / 10, 4), "last10_reward": round(sum(r[-10:]) / 10, 4),
            "first10_calls_per_trajectory": round(sum(c[:10]) / 10, 4),
            "last10_calls_per_trajectory": round(sum(c[-10:]) / 10, 4), **free, "steps": steps}


def table(summary: dict) -> str:
    lines = ["| step | reward | tool calls / trajectory | free call rate | turns |", "|---:|---:|---:|---:|---:|"]
    for s in summary["steps"]:
        if s["step"] == 1 or s["step"] % 10 == 0:
            free = "-" if s.get("free_call_rate") is None else f"{s['free_call_rate']:.2f}"
            lines.append(f"| {s['step']} | {s['reward']:.3f} | {s['tool_calls_per_trajectory']:.2f} | {free} | "
                         f"{s['turns']:.2f} |")
    return "\n".join(lines)


def plot(summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in summary["steps"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(x, [s["reward"] for s in summary["steps"]], label="reward (right digit)")
    ax.plot(x, [s["tool_calls_per_trajectory"] for s in summary["steps"]], color="tab:green",
            label="tool calls per trajectory")
    free = [(s["step"], s["free_call_rate"]) for s in summary["steps"] if s.get("free_call_rate") is not None]
    if free:
        ax.plot([a for a, _ in free], [b for _, b in free], color="tab:red",
                label="free call rate (first turn under auto)")
    ax.axhline(summary["chance"], color="gray", linestyle=":", label="chance")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="run_dir", default=None)
    ap.add_argument("--auto-from", dest="stage1", default=None,
                    help="the second stage (tool_choice=auto) from this first-stage run's weights")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the run (none for the README's numbers)")
    args = ap.parse_args()
    overrides = list(args.overrides)
    results, plot_path = RESULTS, PLOT
    title = "recipe=tool-peek-tiny-cpu: the tiny model from random weights (CPU)"
    if args.stage1 is not None:
        overrides = auto_overrides(args.stage1) + overrides
        results, plot_path = RESULTS.replace("_cpu", "_auto_cpu"), PLOT.replace("_cpu", "_auto_cpu")
        title = "tool_choice=auto from the first stage's weights: the call is the policy's (CPU)"
    command = " ".join(["mgrpo-train recipe=tool-peek-tiny-cpu", *overrides])
    seconds = None
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="tool-peek-")
        t0 = time.perf_counter()
        # the weights are kept (RUN_DIR/hf): the second stage starts from them
        subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", "recipe=tool-peek-tiny-cpu",
                        f"trainer.output_dir={run_dir}", *overrides], check=True)
        seconds = round(time.perf_counter() - t0, 1)
    summary = summarise(run_dir, seconds, command)
    with open(results, "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, plot_path, title)
    print(f"{run_dir}: first-10 reward {summary['first10_reward']}, last-10 {summary['last10_reward']} (chance 0.1); "
          f"calls per trajectory first-10 {summary['first10_calls_per_trajectory']}, "
          f"last-10 {summary['last10_calls_per_trajectory']}" + (
              f"; free call rate first-10 {summary['first10_free_call_rate']}, last-10 "
              f"{summary['last10_free_call_rate']}" if "first10_free_call_rate" in summary else ""))
    print(table(summary))


if __name__ == "__main__":
    main()
