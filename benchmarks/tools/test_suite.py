"""The test suite by tier, as the README and CI run it: each tier's command timed on this machine, its counts,
the load, and from the durations file tests/conftest.py writes, each tier's summed test seconds and its slowest
tests (so a test moves tier by data). Writes benchmarks/results/test_suite_cpu.json (or --out), which the
README's tier table is rendered from (benchmarks/tools/readme_table.py, block `test-tiers`).

    python -m benchmarks.tools.test_suite                        # unit, then the README's command, then system
    python -m benchmarks.tools.test_suite --tiers unit           # one command only (the others' entries are kept)

The README's command (unit + integration) runs the unit tier again; `unit` is timed alone because it is the
inner loop's budget (3 minutes on the 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import REPO, RESULTS
from benchmarks.tools.proctree import machine

COMMANDS = {
    "unit": ["-m", "unit"],
    "readme": ["-m", "not system"],  # the README's test command: unit + integration
    "system": ["-m", "system"],
}
BUDGET_S = {"unit": 180, "readme": 1200, "system": None}
"""Issue 29's budgets on the 2-core machine: unit <= 3 min, the README's command <= 20 min; .ci/run (install,
SLURM, both commands) <= 50 min."""


def run_tier(name: str) -> dict:
    args = COMMANDS[name]
    slug = re.sub(r"\W+", "_", args[1])  # the file name tests/conftest.py gives this -m selection
    durations = os.path.join(REPO, "outputs", "tests", f"durations_{slug}.json")
    load, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True)
    wall = time.time() - t0
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)}
    out = {"command": "python -m pytest " + " ".join(a if " " not in a else f'"{a}"' for a in args),
           "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
           "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
           "exit_status": proc.returncode, "wall_s": round(wall, 1), "budget_s": BUDGET_S[name],
           "load_1m_at_start": round(load, 2), "load_1m_at_end": round(os.getloadavg()[0], 2), "summary": summary}
    if os.path.isfile(durations):
        with open(durations) as f:
            tests = json.load(f)["tests"]
        out["test_seconds_by_tier"] = {t: round(sum(r["seconds"] for r in tests.values() if r["tier"] == t), 1)
                                       for t in ("unit", "integration", "system")}
        out["tests_by_tier"] = {t: sum(r["tier"] == t for r in tests.values()) for t in ("unit", "integration",
                                                                                            "system")}
        slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:15]
        out["slowest"] = [{"test": k, "tier": r["tier"], "seconds": r["seconds"]} for k, r in slowest]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="unit,readme,system", help="comma-separated: unit, readme, system")
    ap.add_argument("--out", default=os.path.join(RESULTS, "test_suite_cpu.json"))
    args = ap.parse_args(argv)
    tiers = args.tiers.split(",")
    unknown = set(tiers) - set(COMMANDS)
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
        r = run_tier(name)
        r.update(commit=commit, modified_tracked_files=dirty)
        result["tiers"][name] = r
        budget = f" (budget {r['budget_s'] / 60:.0f} min)" if r["budget_s"] else ""
        print(f"{name}: {r['summary']} in {r['wall_s'] / 60:.1f} min{budget} at load "
              f"{r['load_1m_at_start']:.1f}-{r['load_1m_at_end']:.1f}", flush=True)
        status = status or r["exit_status"]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
