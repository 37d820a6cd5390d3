"""The test suite as CI runs it (`python -m pytest`, the README's command): how many tests passed, skipped and
failed, and how long it took. Writes benchmarks/results/test_suite_cpu.json (or --out), which the README's
Results table is rendered from (benchmarks/tools/readme_table.py). Takes 25+ minutes on the 2-core machine.

    python -m benchmarks.tools.test_suite
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "test_suite_cpu.json"))
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.splitlines()
    load, t0 = os.getloadavg()[0], time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest"], cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)", summary)}
    result = {"command": "python -m pytest", "commit": commit, "modified_tracked_files": dirty,
              "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
              "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
              "exit_status": proc.returncode, "wall_s": wall, "load_1m_at_start": load,
              "load_1m_at_end": os.getloadavg()[0], "summary": summary}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{summary}\nwrote {args.out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
