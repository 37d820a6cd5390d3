"""The standing performance comparisons in one command, one line per run appended to a history, and a loud
line when a number got more than 10% worse than the previous run's.

    python -m benchmarks.tools.perf_history                    # all, appended to outputs/benchmarks/perf_history.jsonl
    python -m benchmarks.tools.perf_history --update-results   # appended to benchmarks/results/perf_history.jsonl
    python -m benchmarks.tools.perf_history --only tiny        # one comparison (tiny, qwen3vocab, kernel)

The comparisons, each its own benchmark run in a child process (their JSON kept beside the history, under
outputs/benchmarks/perf_history_runs/<commit>/):
  tiny        mgrpo vs TRL's GRPOTrainer on the tiny workload, lockstep (benchmarks.peers.grpo_vs_trl, its defaults)
  qwen3vocab  the same at Qwen3's 151,936-token vocabulary, 2 prompts x 8 (1 warm-up + 2 timed steps)
  kernel      the fused log-prob kernel against full logits on CPU (T=1024, H=1024, V=151,936, fp32, fwd+bwd)
A line holds the commit, the load, each comparison's mgrpo/TRL ratios (step, peak PSS and RSS, response tokens/s,
time to first step) and both sides' per-phase medians. The README's performance table is rendered from the last
line of the committed history (benchmarks/tools/readme_table.py, block `perf`). Lower is better for every number
compared; a number more than 10% above the previous line's is printed as a REGRESSION (and, with
--fail-on-regression, makes the exit status 1). Numbers from a loaded machine compare badly: the load is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import OUTPUTS, REPO, add_output_args, checkout_state, output_path
from benchmarks.tools.proctree import machine

COMPARISONS = {
    "tiny": ["benchmarks.peers.grpo_vs_trl"],
    "qwen3vocab": ["benchmarks.peers.grpo_vs_trl", "--workload", "qwen3vocab", "--prompts", "2", "--warmup", "1",
                   "--steps", "2", "--last", "3"],
    "kernel": ["benchmarks.peers.kernel_bench", "--T", "1024", "--H", "1024", "--V", "151936", "--dtype", "fp32",
               "--impls", "naive,chunked", "--repeats", "3"],
}
WATCHED = {  # lower is better for each; compared against the previous line
    "tiny": ("step_ratio", "pss_ratio", "mgrpo_time_to_first_step_s"),
    "qwen3vocab": ("step_ratio", "pss_ratio"),
    "kernel": ("chunked_median_s", "chunked_peak_extra_mib"),
}
REGRESSION = 1.10


def _trl_line(path: str) -> dict:
    with open(path + ".json") as f:
        got = json.load(f)
    mg, trl, ratio = got["results"]["mgrpo"], got["results"]["trl"], got["ratios_mgrpo_over_trl"]
    return {"step_ratio": ratio["median_step_s"], "pss_ratio": ratio["peak_pss_tree_mib"],
            "rss_ratio": ratio["peak_rss_tree_mib"], "response_tokens_per_s_ratio": ratio["response_tokens_per_s"],
            "mgrpo_median_step_s": mg["median_step_s"], "trl_median_step_s": trl["median_step_s"],
            "mgrpo_peak_pss_mib": mg["peak_pss_tree_mib"], "trl_peak_pss_mib": trl["peak_pss_tree_mib"],
            "mgrpo_time_to_first_step_s": mg["time_to_first_step_s"],
            "trl_time_to_first_step_s": trl["time_to_first_step_s"],
            "mgrpo_phases_s": mg["aligned_phase_medians_s"], "trl_phases_s": trl["aligned_phase_medians_s"]}


def _kernel_line(path: str) -> dict:
    import csv

    with open(path, newline="") as f:
        rows = {r["impl"]: r for r in csv.DictReader(f)}
    line = {}
    for impl, r in rows.items():
        line[f"{impl}_median_s"] = float(r["median_s"])
        line[f"{impl}_peak_extra_mib"] = float(r["peak_extra_mib"])
    return line


def run(name: str, folder: str, timeout_s: float) -> dict:
    """One comparison in a child process; its numbers, or why there are none."""
    out = os.path.join(folder, name + (".csv" if name == "kernel" else ""))
    cmd = [sys.executable, "-m", *COMPARISONS[name], "--out", out]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "command": " ".join(cmd[1:])}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}", "command": " ".join(cmd[1:])}
    line = _kernel_line(out) if name == "kernel" else _trl_line(out)
    return {**line, "wall_s": round(time.time() - t0, 1), "command": "python -m " + " ".join(COMPARISONS[name])}


def regressions(previous: dict, line: dict) -> list[str]:
    """Each watched number more than 10% above the previous line's, as a sentence."""
    found = []
    for name, keys in WATCHED.items():
        old, new = previous.get(name) or {}, line.get(name) or {}
        for key in keys:
            if isinstance(old.get(key), (int, float)) and isinstance(new.get(key), (int, float)) and old[key] > 0 \
                    and new[key] > REGRESSION * old[key]:
                found.append(f"{name} {key}: {old[key]:.4g} -> {new[key]:.4g} (+{100 * (new[key] / old[key] - 1):.0f}%"
                             f", previous line {previous.get('commit', '?')} at load {previous.get('load_1m_at_start')})")
    return found


def last_line(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = [ln for ln in f if ln.strip()]
    return json.loads(lines[-1]) if lines else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(COMPARISONS), help=f"comma list of {', '.join(COMPARISONS)}")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each comparison")
    ap.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a number regressed > 10%%")
    add_output_args(ap, "perf_history.jsonl")
    args = ap.parse_args(argv)
    history = output_path(args, "perf_history.jsonl")
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(COMPARISONS)
    if unknown:
        ap.error(f"unknown comparisons {sorted(unknown)}; known: {list(COMPARISONS)}")
    commit, dirty = checkout_state()
    folder = os.path.join(OUTPUTS, "perf_history_runs", commit)
    os.makedirs(folder, exist_ok=True)
    line = {"commit": commit, "modified_tracked_files": dirty, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime()),
            "load_1m_at_start": round(os.getloadavg()[0], 2), "cpu_model": machine()["cpu_model"]}
    for name in names:
        print(f"{name}: python -m {' '.join(COMPARISONS[name])}", flush=True)
        line[name] = run(name, folder, args.timeout)
        print(f"  {json.dumps({k: v for k, v in line[name].items() if not isinstance(v, dict)})}", flush=True)
    line["load_1m_at_end"] = round(os.getloadavg()[0], 2)
    previous = last_line(history)
    with open(history, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"appended to {history}")
    found = regressions(previous, line) if previous else []
    if found:
        bar = "!" * 100
        print(f"\n{bar}\nREGRESSION: {len(found)} number(s) more than 10% worse than the previous line:\n  "
              + "\n  ".join(found) + f"\n{bar}", flush=True)
    failed = [n for n in names if "error" in line[n]]
    for n in failed:
        print(f"{n} FAILED: {line[n]['error']}", file=sys.stderr)
    return 1 if failed or (found and args.fail_on_regression) else 0


if __name__ == "__main__":
    sys.exit(main())
