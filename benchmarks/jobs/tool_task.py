"""The README's tool task (recipe=tool-peek-tiny-cpu), run as a user runs it, summarised for the README.

    python -m benchmarks.jobs.tool_task                    # runs it (minutes on 2 cores)
    python -m benchmarks.jobs.tool_task --from RUN_DIR [--seconds S]  # summarises a finished run (S: its wall time)
    python -m benchmarks.jobs.tool_task --plot             # draws the plot again from the results JSON
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
            "rollout.multi_turn.required_per_group=0",  # every call the policy's (the recipe forces 6 of 8)
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


def _series(summary: dict) -> list[tuple[str, str, list[tuple[int, float]]]]:
    """(label, colour, points) of each line of the plot."""
    steps = summary["steps"]
    out = [("reward (right digit)", "tab:blue", [(s["step"], s["reward"]) for s in steps]),
           ("tool calls per trajectory", "tab:green", [(s["step"], s["tool_calls_per_trajectory"]) for s in steps])]
    free = [(s["step"], s["free_call_rate"]) for s in steps if s.get("free_call_rate") is not None]
    if free:
        out.append(("free call rate (first turn under auto)", "tab:red", free))
    return out


def plot(summary: dict, path: str, title: str) -> None:
    """matplotlib's plot (pip install -e .[bench]); without it the same lines drawn with Pillow (a dependency of
    the tokenizers' stack), so that the README's plot follows its JSON on a machine without the bench extra."""
    try:
        import matplotlib
    except ImportError:
        return _plot_pillow(summary, path, title)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, colour, points in _series(summary):
        ax.plot([a for a, _ in points], [b for _, b in points], color=colour, label=label)
    ax.axhline(summary["chance"], color="gray", linestyle=":", label="chance")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _plot_pillow(summary: dict, path: str, title: str) -> None:
    from PIL import Image, ImageDraw

    rgb = {"tab:blue": (31, 119, 180), "tab:green": (44, 160, 44), "tab:red": (214, 39, 40), "gray": (128, 128, 128)}
    w, h, left, right, top, bottom = 860, 315, 45, 245, 30, 35  # the legend right of the plot
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    last = max(s["step"] for s in summary["steps"])
    px = lambda step: left + (step - 1) / max(last - 1, 1) * (w - left - right)  # noqa: E731
    py = lambda v: top + (1.05 - v) / 1.07 * (h - top - bottom)  # noqa: E731
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for v in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        d.line([left - 4, py(v), left, py(v)], fill="black")
        d.text((left - 30, py(v) - 6), f"{v:.1f}", fill="black")
    for step in range(0, last + 1, 20):
        d.line([px(max(step, 1)), h - bottom, px(max(step, 1)), h - bottom + 4], fill="black")
        d.text((px(max(step, 1)) - 8, h - bottom + 6), str(step), fill="black")
    d.text((w // 2 - 12, h - 16), "step", fill="black")
    d.text((left, 8), title, fill="black")
    x = left
    while x < w - right:  # chance, dotted
        d.line([x, py(summary["chance"]), x + 2, py(summary["chance"])], fill=rgb["gray"])
        x += 6
    legend = [("chance", "gray")]
    for label, colour, points in _series(summary):
        d.line([(px(a), py(b)) for a, b in points], fill=rgb[colour], width=2)
        legend.append((label, colour))
    x0, y0 = w - right + 8, top + (h - top - bottom) // 2 - 7 * len(legend)
    for i, (label, colour) in enumerate(legend):
        y = y0 + 4 + 14 * i
        d.line([x0 + 5, y + 6, x0 + 25, y + 6], fill=rgb[colour], width=2)
        d.text((x0 + 30, y), label, fill="black")
    img.save(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="run_dir", default=None)
    ap.add_argument("--plot", action="store_true", help="only draw the plot from the results JSON (matplotlib: "
                    "pip install -e .[bench])")
    ap.add_argument("--seconds", type=float, default=None, help="with --from: the run's wall time, as measured")
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
    if args.plot:
        with open(results) as f:
            plot(json.load(f), plot_path, title)
        return
    command = " ".join(["mgrpo-train recipe=tool-peek-tiny-cpu", *overrides])
    seconds = args.seconds
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
    print(f"{run_dir}: first-10 reward {summary['first10_reward']}, last-10 {summary['last10_reward']} (chance 0.1); "
          f"calls per trajectory first-10 {summary['first10_calls_per_trajectory']}, "
          f"last-10 {summary['last10_calls_per_trajectory']}" + (
              f"; free call rate first-10 {summary['first10_free_call_rate']}, last-10 "
              f"{summary['last10_free_call_rate']}" if "first10_free_call_rate" in summary else ""))
    print(table(summary))
    plot(summary, plot_path, title)  # last: without matplotlib the JSON and the table are there (then --plot)


if __name__ == "__main__":
    main()
