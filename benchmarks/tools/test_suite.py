"""The test suite by tier, as the README and CI run it: each tier's command timed on this machine, its counts,
the load, and from the durations file tests/conftest.py writes, each tier's summed test seconds and its slowest
tests (so a test moves tier by data). Writes outputs/benchmarks/test_suite_cpu.json; with --update-results the
committed benchmarks/results/test_suite_cpu.json, which the README's tier table is rendered from
(benchmarks/tools/readme_table.py, block `test-tiers`), and every test's seconds to tests/durations_cpu.json, by
which tests/conftest.py hands tests out longest first under xdist.

    python -m benchmarks.tools.test_suite --update-results       # -m unit, then `bash .ci/run`
    python -m benchmarks.tools.test_suite --tiers unit,readme,system   # each pytest command on its own

`ci` runs `.ci/run` as CI does (install, SLURM up, the README's command, then the system tier, SLURM down): its
wall time is the 50-minute budget's, and the README's command's and the system tier's entries come from its two
pytest runs (their own "in N s", which leaves out pytest's start-up). The README's command (unit + integration)
runs the unit tier again; `unit` is timed alone because it is the inner loop's budget (3 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import machine

COMMANDS = {
    "unit": ["-m", "unit"],
    "readme": ["-m", "not system", "-n", "2"],  # the README's test command: unit + integration
    "system": ["-m", "system", "-n", "2"],  # as .ci/run runs it
}
BUDGET_S = {"unit": 180, "readme": 1200, "system": None, "ci": 3000}
"""The budgets on the 2-core machine: unit <= 3 min, the README's command <= 20 min; .ci/run (install,
SLURM, both commands) <= 50 min."""


def _counts(summary: str) -> dict:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)}
    return {"passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)}


def _from_durations(args: list[str]) -> dict:
    slug = re.sub(r"\W+", "_", args[1])  # the file name tests/conftest.py gives this -m selection
    path = os.path.join(REPO, "outputs", "tests", f"durations_{slug}.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        tests = json.load(f)["tests"]
    tiers = ("unit", "integration", "system")
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:15]
    return {"test_seconds_by_tier": {t: round(sum(r["seconds"] for r in tests.values() if r["tier"] == t), 1)
                                     for t in tiers},
            "tests_by_tier": {t: sum(r["tier"] == t for r in tests.values()) for t in tiers},
            "slowest": [{"test": k, "tier": r["tier"], "seconds": r["seconds"]} for k, r in slowest]}


def write_test_seconds(commit: str, path: str = os.path.join(REPO, "tests", "durations_cpu.json")) -> int:
    """Every test's seconds from this run's durations files (the README's command and the system tier), over
    the previous ones; returns how many tests it holds."""
    seconds = {}
    if os.path.isfile(path):
        with open(path) as f:
            seconds = json.load(f).get("seconds", {})
    for name in ("readme", "system"):
        slug = re.sub(r"\W+", "_", COMMANDS[name][1])
        run = os.path.join(REPO, "outputs", "tests", f"durations_{slug}.json")
        if os.path.isfile(run):
            with open(run) as f:
                seconds.update({k: round(r["seconds"], 1) for k, r in json.load(f)["tests"].items()})
    about = ("Per-test seconds on the 2-core CPU machine, from outputs/tests/durations_*.json of the README's "
             "command and the system tier (python -m benchmarks.tools.test_suite rewrites it). Under xdist, "
             "tests/conftest.py hands tests out longest first by these.")
    with open(path, "w") as f:
        json.dump({"about": about, "measured_at_commit": commit[:7], "seconds": dict(sorted(seconds.items()))}, f,
                  indent=0)
    return len(seconds)


def _command(args: list[str]) -> str:
    return "python -m pytest " + " ".join(a if " " not in a else f'"{a}"' for a in args)


def run_ci() -> dict[str, dict]:
    """`bash .ci/run` as CI runs it; entries for it and for its two pytest runs."""
    load, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run(["bash", ".ci/run"], cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    # The whole output kept (untracked): a failure seen only in the timed run must leave its traceback behind.
    log_path = os.path.join(REPO, "outputs", "tests", "ci_run.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    summaries = [ln.strip("= ") for ln in proc.stdout.splitlines()
                 if re.match(r"^=+ .*\b(passed|failed|error)\b.* in [\d.]+s", ln)]
    out = {"ci": {"command": "bash .ci/run", "exit_status": proc.returncode, "wall_s": round(wall, 1),
                  "log": os.path.relpath(log_path, REPO),
                  "budget_s": BUDGET_S["ci"], "load_1m_at_start": round(load, 2),
                  "load_1m_at_end": round(os.getloadavg()[0], 2), "summaries": summaries,
                  "passed": 0, "skipped": 0, "failed": 0}}
    for name, summary in zip(("readme", "system"), summaries):
        secs = float(re.search(r" in ([\d.]+)s", summary).group(1))
        out[name] = {"command": _command(COMMANDS[name]), **_counts(summary), "exit_status": None,
                     "wall_s": round(secs, 1), "budget_s": BUDGET_S[name], "load_1m_at_start": round(load, 2),
                     "load_1m_at_end": round(os.getloadavg()[0], 2), "summary": summary, "within": "bash .ci/run",
                     **_from_durations(COMMANDS[name])}
        for k in ("passed", "skipped", "failed"):
            out["ci"][k] += out[name][k]
    if len(summaries) != 2:
        out["ci"]["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return out


def run_tier(name: str) -> dict:
    args = COMMANDS[name]
    load, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True)
    wall = time.time() - t0
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else ""
    return {"command": _command(args), **_counts(summary), "exit_status": proc.returncode, "wall_s": round(wall, 1),
            "budget_s": BUDGET_S[name], "load_1m_at_start": round(load, 2),
            "load_1m_at_end": round(os.getloadavg()[0], 2), "summary": summary, **_from_durations(args)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="unit,ci", help="comma-separated: unit, readme, system, ci")
    add_output_args(ap, "test_suite_cpu.json")
    args = ap.parse_args(argv)
    args.out = output_path(args, "test_suite_cpu.json")
    tiers = args.tiers.split(",")
    unknown = set(tiers) - set(COMMANDS) - {"ci"}
    if unknown:
        ap.error(f"unknown tiers {sorted(unknown)}; known: {list(COMMANDS)}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.splitlines()
    result = {"machine": machine(packages=("torch", "ray", "megatron-core", "pytest")), "tiers": {}}
    if os.path.isfile(args.out):  # one tier at a time keeps the others' entries
        with open(args.out) as f:
            result["tiers"] = json.load(f).get("tiers", {})
    status = 0
    for name in tiers:
        got = run_ci() if name == "ci" else {name: run_tier(name)}
        for key, r in got.items():
            r.update(commit=commit, modified_tracked_files=dirty)
            result["tiers"][key] = r
            budget = f" (budget {r['budget_s'] / 60:.0f} min)" if r["budget_s"] else ""
            print(f"{key}: {r['passed']} passed, {r['skipped']} skipped, {r['failed']} failed in "
                  f"{r['wall_s'] / 60:.1f} min{budget} at load {r['load_1m_at_start']:.1f}-{r['load_1m_at_end']:.1f}",
                  flush=True)
            status = status or (r["exit_status"] or 0)
    # Written once at the end: tests/benchmarks/test_readme_results.py, in the runs above, compares the README with the
    # committed file, which must not change under it.
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    if args.update_results:
        print(f"wrote tests/durations_cpu.json ({write_test_seconds(commit)} tests)")
    return status


if __name__ == "__main__":
    sys.exit(main())
