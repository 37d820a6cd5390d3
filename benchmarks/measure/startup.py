"""The tiny job's fixed costs, mgrpo alone: time to the first step, where it goes, and the process tree's memory.

    python -m benchmarks.measure.startup                                   # 3 runs of this checkout
    python -m benchmarks.measure.startup --tree base=/tmp/base --tree new=. --repeats 4   # A/B, interleaved

Each run is grpo_vs_trl.py's mgrpo child on the tiny workload (same spec, same initial weights, same Ray
settings and priority), without TRL and without lockstep: it starts, runs --steps steps and exits. Per run:
time from launch to the first step's start (what grpo_vs_trl.py calls time to first step), the start-up phases
the run logs (`start | <phase> in <s>`), the peak PSS of the whole process tree (sampled every second) and what
each kind of process held in that sample. With several --tree checkouts the runs alternate, the order flipping
each repeat (A B, B A, ...), so load from other jobs on the machine reaches each alike; the load average is recorded per run. Medians per
checkout are printed and written with every run to <out>.json. It reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import add_output_args, output_path
from benchmarks.peers.grpo_vs_trl import Side, prepare
from benchmarks.peers.grpo_workloads import WORKLOADS
from benchmarks.tools.proctree import machine

PHASE = re.compile(r"start \| (.+?) in ([0-9.]+)s")


def run_once(name: str, repo: str | None, base: dict, workdir: str, index: int, timeout: float) -> dict:
    run = f"{name}_{index}"
    spec = {**base, "name": run, "run_dir": os.path.join(workdir, run),
            "result_path": os.path.join(workdir, f"{run}.result.json")}
    load = os.getloadavg()[0]
    side = Side("mgrpo", spec, workdir, repo=repo)
    try:
        side.wait_ready(timeout)
        first = time.time() - side.t_launch
        for step in range(base["total_steps"]):
            side.go()
            if step < base["total_steps"] - 1:
                side.wait_ready(timeout)
        res = side.finish(timeout)
    except BaseException:
        side.kill()
        raise
    with open(side.log_path) as f:
        phases = {m.group(1): float(m.group(2)) for m in PHASE.finditer(f.read())}
    mem = res["memory"]
    return {"tree": name, "index": index, "load_1m_at_start": load, "time_to_first_step_s": first,
            "phases_s": phases, "peak_pss_tree_mib": mem["peak_pss_tree_mib"],
            "peak_rss_tree_mib": mem["peak_rss_tree_mib"], "pss_at_peak_mib": mem["pss_at_peak_mib"],
            "log": side.log_path}


def summary(runs: list[dict]) -> dict:
    med = statistics.median
    phases = sorted({p for r in runs for p in r["phases_s"]}, key=lambda p: -med(
        [r["phases_s"].get(p, 0.0) for r in runs]))
    kinds = sorted({k for r in runs for k in r["pss_at_peak_mib"]})
    return {
        "runs": len(runs),
        "time_to_first_step_s": med([r["time_to_first_step_s"] for r in runs]),
        "time_to_first_step_runs_s": [round(r["time_to_first_step_s"], 2) for r in runs],
        "peak_pss_tree_mib": med([r["peak_pss_tree_mib"] for r in runs]),
        "peak_pss_runs_mib": [round(r["peak_pss_tree_mib"]) for r in runs],
        "load_1m": [r["load_1m_at_start"] for r in runs],
        "phases_s": {p: med([r["phases_s"].get(p, 0.0) for r in runs]) for p in phases},
        "pss_at_peak_mib": dict(sorted(((k, med([r["pss_at_peak_mib"].get(k, 0.0) for r in runs])) for k in kinds),
                                       key=lambda kv: -kv[1])),
    }


def render(summaries: dict[str, dict]) -> str:
    names = list(summaries)
    w = max(12, *(len(n) for n in names))
    lines = [f"{'median of runs':44}" + "".join(f"{n:>{w}}" for n in names)]

    def row(label, vals, fmt):
        lines.append(f"{label[:44]:44}" + "".join(f"{fmt.format(v) if v is not None else '-':>{w}}" for v in vals))

    row("time to first step (s)", [s["time_to_first_step_s"] for s in summaries.values()], "{:.1f}")
    row("peak PSS of the tree (MiB)", [s["peak_pss_tree_mib"] for s in summaries.values()], "{:.0f}")
    phases = list(dict.fromkeys(p for s in summaries.values() for p in s["phases_s"]))
    lines.append("start-up phases the run logs (s):")
    for p in phases:
        row("  " + p, [s["phases_s"].get(p) for s in summaries.values()], "{:.1f}")
    lines.append("PSS at the tree's peak, per kind of process (MiB):")
    kinds = list(dict.fromkeys(k for s in summaries.values() for k in s["pss_at_peak_mib"]))
    for k in kinds:
        row("  " + k, [s["pss_at_peak_mib"].get(k) for s in summaries.values()], "{:.0f}")
    for n, s in summaries.items():
        lines.append(f"{n}: time to first step per run {s['time_to_first_step_runs_s']}, peak PSS per run "
                     f"{s['peak_pss_runs_mib']}, load at start {s['load_1m']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a checkout to measure (repeatable; its path goes first on the child's PYTHONPATH, "
                         "several paths joined by ':'); default: this checkout, named 'this'")
    ap.add_argument("--repeats", type=int, default=3, help="runs per checkout (default 3)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default 6: the peak is a step's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for start-up or for one step")
    add_output_args(ap, "startup_cpu")
    a = ap.parse_args(argv)
    trees = [t.split("=", 1) for t in a.tree] or [["this", None]]
    if any(len(t) != 2 for t in trees) or a.repeats < 1 or a.steps < 1:
        ap.error("--tree takes NAME=PATH; --repeats and --steps need >= 1")
    out = output_path(a, "startup_cpu")
    meta = {"command": " ".join(["python", "-m", "benchmarks.measure.startup"] + sys.argv[1:]), "machine": machine(),
            "trees": {n: p for n, p in trees}}
    workdir = tempfile.mkdtemp(prefix="startup-")
    try:
        base = prepare(WORKLOADS["tiny"], workdir, a.steps, threads=1)
        runs: list[dict] = []
        for i in range(a.repeats):
            # A B, B A, A B, ...: load that rises or falls during a repeat reaches each checkout alike
            for name, repo in (trees if i % 2 == 0 else trees[::-1]):
                r = run_once(name, repo, base, workdir, i, a.timeout)
                runs.append(r)
                print(f"  {name} run {i}: first step at {r['time_to_first_step_s']:.1f}s, peak PSS "
                      f"{r['peak_pss_tree_mib']:.0f} MiB (load {r['load_1m_at_start']:.1f})", flush=True)
        summaries = {n: summary([r for r in runs if r["tree"] == n]) for n, _ in trees}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = render(summaries)
    print("\n" + table)
    meta["machine"]["loadavg_at_end"] = os.getloadavg()
    with open(out + ".json", "w") as f:
        json.dump({**meta, "summary": summaries, "table": table, "runs": runs}, f, indent=1)
    print(f"\nwrote {out}.json")


if __name__ == "__main__":
    main()
