"""What a heap trim after every call costs a call that frees little (mgrpo/heap.py, `trim_after_call`).

    python -m benchmarks.measure.call_trim                 # writes outputs/benchmarks/call_trim.json

One process with one malloc arena (a Megatron rank's MALLOC_ARENA_MAX=1, set here before the first
allocation by re-executing itself) runs a "call": 200 CPU tensors of 4-800 KB allocated and freed, one in
50 kept (what pins the heap's holes). It times the call alone, and the call followed by `malloc_trim(0)`,
alternating, and `trim_heap`/`trim_after_call` themselves. Prints medians in ms and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from benchmarks import add_output_args, output_path
from benchmarks.tools.proctree import machine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tensors", type=int, default=200)
    add_output_args(ap, "call_trim")
    a = ap.parse_args(argv)
    if os.environ.get("MALLOC_ARENA_MAX") != "1":  # glibc reads it at the process's first allocation
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.measure.call_trim", *(argv or sys.argv[1:])],
                  {**os.environ, "MALLOC_ARENA_MAX": "1"})
    import torch

    from mgrpo.heap import resident_bytes, trim_after_call, trim_heap

    if not trim_heap():
        raise SystemExit("call_trim: this C library has no malloc_trim")
    rng = random.Random(0)
    keep = []

    def call() -> float:
        t0 = time.perf_counter()
        ts = [torch.empty(rng.randint(1000, 200_000)) for _ in range(a.tensors)]
        keep.extend(ts[::50])
        del ts
        return time.perf_counter() - t0

    for _ in range(5):
        call()
    plain, trimmed, trim_s, gate_s = [], [], [], []
    for _ in range(a.rounds):
        plain.append(call())
        trimmed.append(call())
        t0 = time.perf_counter()
        trim_heap()
        trim_s.append(time.perf_counter() - t0)
        trimmed.append(call())  # the call after a trim refills what the trim returned
        t0 = time.perf_counter()
        trim_after_call()
        gate_s.append(time.perf_counter() - t0)
        trim_heap()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 4)  # noqa: E731
    out = {"call_ms": ms(plain), "call_after_trim_ms": ms(trimmed[1::2]), "trim_heap_ms": ms(trim_s),
           "trim_after_call_ms": ms(gate_s), "rounds": a.rounds, "tensors": a.tensors,
           "resident_mib": round(resident_bytes() / 2**20, 1), "machine": machine(),
           "command": "python -m benchmarks.measure.call_trim " + " ".join(argv or sys.argv[1:])}
    for k in ("call_ms", "call_after_trim_ms", "trim_heap_ms", "trim_after_call_ms"):
        print(f"{k:22} {out[k]:8.3f}")
    path = output_path(a, "call_trim") + ".json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
