"""Latency and calls per second of the code sandbox against a bare `subprocess.run`.

    python -m benchmarks.measure.sandbox [--calls 40] [--threads 2]                # writes outputs/benchmarks/
    python -m benchmarks.measure.sandbox --update-results   # also replaces benchmarks/results/sandbox_cpu.*

Two programs: `trivial` (print one number) and `numpy_sympy` (import both, solve a 60x60 system and
integrate a product symbolically: what a math tool call does). Three ways to run each:
- `bare`: `subprocess.run([sys.executable, "-c", code])`, no isolation: the floor every sandbox pays too;
- `sandbox`: `Sandbox.run` with its pool (sandbox.pool_size=2 pre-started, each a fresh process used once);
- `sandbox_cold`: the same with pool_size=0: namespaces, mounts and the interpreter started inside the call.
Sequential: `--calls` calls of each way, interleaved call by call so the shared machine's load hits all alike;
p50/p99/mean latency and calls/s (1 / mean). Concurrent: `--threads` threads making `--calls` calls in all,
calls/s of bare against sandbox (max_concurrency = threads). The overhead is sandbox p50 - bare p50.

A benchmark reports numbers; it asserts nothing. The machine's load at the start is in the JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import REPO, RESULTS

PROGRAMS = {
    "trivial": "print(6 * 7)",
    "numpy_sympy": ("import numpy as np, sympy as sp\n"
                    "a = np.random.default_rng(0).standard_normal((60, 60)); b = np.ones(60)\n"
                    "x = sp.symbols('x')\n"
                    "print(round(float(np.linalg.solve(a, b).sum()), 6), sp.integrate(x**2 * sp.sin(x), x))"),
}


def bare(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"bare run failed: {out.stderr[-300:]}")
    return out.stdout


def sandboxed(sandbox):
    def call(code: str) -> str:
        result = sandbox.run(code)
        if result.outcome != "ok":
            raise RuntimeError(f"sandboxed run ended {result.outcome}/{result.limit}: {result.stderr[-300:]}")
        return result.stdout
    return call


def stats(ms: list[float]) -> dict:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    mean = statistics.fmean(ms)
    return {"calls": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(p99, 2),
            "mean_ms": round(mean, 2), "calls_per_s": round(1000.0 / mean, 2)}


def sequential(ways: dict, code: str, calls: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in ways}
    warm_up = [call(code) for call in ways.values()]  # one each: imports into the page cache, the pool filled
    expected = warm_up[0]
    for _ in range(calls):
        for name, call in ways.items():
            t0 = time.perf_counter()
            out = call(code)
            times[name].append((time.perf_counter() - t0) * 1000)
            if out != expected:
                raise RuntimeError(f"{name} printed {out!r}, bare printed {expected!r}")
    return {name: stats(ms) for name, ms in times.items()}


def concurrent(call, code: str, calls: int, threads: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: call(code), range(calls)))
        return calls / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "benchmarks"), help="folder to write to")
    ap.add_argument("--update-results", action="store_true", help="write benchmarks/results/sandbox_cpu.* too")
    args = ap.parse_args(argv)
    from benchmarks.tools.proctree import machine
    from mgrpo.config.schema import SandboxConfig
    from mgrpo.sandbox import Sandbox

    info = machine(packages=("numpy", "sympy"))
    rows = []
    # generous time limits: a loaded shared machine must not turn a slow call into a timeout here
    limits = dict(wall_time_s=120.0, cpu_time_s=120, max_concurrency=args.threads)
    with Sandbox(SandboxConfig(pool_size=2, **limits), announce=False) as warm, \
            Sandbox(SandboxConfig(pool_size=0, **limits), announce=False) as cold:
        level = warm.level
        for program, code in PROGRAMS.items():
            got = sequential({"bare": bare, "sandbox": sandboxed(warm), "sandbox_cold": sandboxed(cold)}, code,
                             args.calls)
            for way, s in got.items():
                rows.append({"program": program, "way": way, "isolation": "none" if way == "bare" else level,
                             "threads": 1, **s,
                             "p50_overhead_ms": round(s["p50_ms"] - got["bare"]["p50_ms"], 2)})
            for way, call in (("bare", bare), ("sandbox", sandboxed(warm))):
                rate = concurrent(call, code, args.calls, args.threads)
                rows.append({"program": program, "way": way, "isolation": "none" if way == "bare" else level,
                             "threads": args.threads, "calls": args.calls, "calls_per_s": round(rate, 2)})
    fields = ["program", "way", "isolation", "threads", "calls", "p50_ms", "p99_ms", "mean_ms", "calls_per_s",
              "p50_overhead_ms"]
    folders = [args.out] + ([RESULTS] if args.update_results else [])
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "sandbox_cpu.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        with open(os.path.join(folder, "sandbox_cpu.json"), "w") as f:
            json.dump({"command": "python -m benchmarks.measure.sandbox " + " ".join(argv or sys.argv[1:]),
                       "isolation": level, "machine": info, "rows": rows}, f, indent=1)
    for row in rows:
        print(",".join(str(row.get(k, "")) for k in fields))
    print(f"wrote {', '.join(os.path.join(f, 'sandbox_cpu.csv') for f in folders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
