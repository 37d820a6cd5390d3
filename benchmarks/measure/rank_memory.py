"""Where a Megatron rank's memory goes, call by call: mgrpo alone on a grpo_vs_trl.py workload.

    python -m benchmarks.measure.rank_memory                          # qwen3vocab, 2 prompts x 8, 3 steps
    python -m benchmarks.measure.rank_memory --prompts 4 --steps 4 --out benchmarks/results/rank_memory_qwen3vocab.json
    python -m benchmarks.measure.rank_memory --prompts 4 --steps 2 --trace-ms 50 actor.max_tokens_per_gpu=2048

Runs `Trainer(config).fit()` with the workload's overrides (grpo_vs_trl.py's mgrpo side, no lockstep, no TRL) and,
inside the rank's process (a Ray actor: reached through a `sitecustomize` module on its PYTHONPATH, this run only),
wraps the rank's calls: the engine's start and `generate`, the actor's start, `compute_logprobs` (the reference
forward), `train_mini_batch` (forward + backward + optimizer) with, inside it, the log-prob kernel and the optimizer
step, and `sync_weights`. Per call: resident size before and after, and the peak during it (VmHWM, reset through
/proc/self/clear_refs at the call's start: exact, no sampling), anonymous / file-backed RSS and PSS after.
Peaks of inner calls are carried into the enclosing call's. With --trace-ms, a thread of the rank also samples its
RSS every that many ms with the calls each thread is inside: where within a call its peak falls (it printed the
decode loop's heap growing to the end of `generate`, mgrpo/heap.py). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

SITECUSTOMIZE = r'''
import functools, importlib.abc, importlib.util, json, os, sys, threading, time
OUT = os.environ["RANK_MEMORY_OUT"]
_stack = []
_active = {}  # thread id -> labels of the wrapped calls it is inside (for the trace)

def _status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

def _pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("Pss:"))

def _wrap(owner, name, label, depth):
    fn = getattr(owner, name)
    @functools.wraps(fn)
    def inner(*a, **k):
        before = _status()
        if _stack:
            _stack[-1] = max(_stack[-1], before["VmHWM"])
        _stack.append(0.0)
        _active.setdefault(threading.get_ident(), []).append(label)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.time()
        try:
            return fn(*a, **k)
        finally:
            after = _status()
            _active[threading.get_ident()].pop()
            peak = max(after["VmHWM"], _stack.pop())
            if _stack:
                _stack[-1] = max(_stack[-1], peak)
            which = a[2] if name == "compute_logprobs" and len(a) > 2 else None
            with open(OUT, "a") as f:
                f.write(json.dumps({"call": label + (f"({which})" if which else ""), "depth": depth,
                                    "seconds": round(time.time() - t0, 3), "rss_before_mib": round(before["VmRSS"]),
                                    "peak_rss_mib": round(peak), "rss_after_mib": round(after["VmRSS"]),
                                    "anon_after_mib": round(after["RssAnon"]), "file_after_mib": round(after["RssFile"]),
                                    "pss_after_mib": round(_pss()), "pid": os.getpid()}) + "\n")
    setattr(owner, name, inner)

def _trace(every_s):
    # RSS every `every_s`, with the wrapped calls each thread is inside: where in a call its peak falls, and
    # whether another thread's work overlaps it
    t0 = time.time()
    with open(OUT + ".trace", "a") as f:
        while True:
            calls = {str(k): list(v) for k, v in list(_active.items()) if v}
            f.write(json.dumps({"t": round(time.time() - t0, 3), "rss_mib": round(_status()["VmRSS"]),
                                "calls": calls}) + "\n")
            f.flush()
            time.sleep(every_s)

def _actor(m):
    import torch, mgrpo_kernels
    if os.environ.get("RANK_MEMORY_TRACE_MS"):
        threading.Thread(target=_trace, args=(float(os.environ["RANK_MEMORY_TRACE_MS"]) / 1000,),
                         daemon=True).start()
    for n in ("__init__", "compute_logprobs", "train_mini_batch", "sync_weights"):
        _wrap(m.MegatronActor, n, "actor." + n.strip("_"), 0)
    _wrap(torch.optim.AdamW, "step", "optimizer step", 1)
    _wrap(mgrpo_kernels, "fused_linear_loss", "log-prob kernel (loss)", 1)
    _wrap(mgrpo_kernels, "linear_logprobs", "log-prob kernel", 1)

def _engine(m):
    for n in ("__init__", "generate"):
        _wrap(m.HFRolloutEngine, n, "engine." + n.strip("_"), 0)

PATCH = {"mgrpo.training.actor": _actor, "mgrpo.rollout.hf_engine": _engine}

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCH:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            PATCH[name](module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Finder())
'''


def child(a) -> None:
    """The mgrpo run itself (in a process whose PYTHONPATH starts with the sitecustomize folder)."""
    import logging

    from benchmarks.peers import grpo_vs_trl as g
    from benchmarks.peers.grpo_workloads import WORKLOADS, compose_mgrpo
    from mgrpo.loop import Trainer

    w = WORKLOADS[a.workload].with_changes(prompts_per_step=a.prompts)
    base = g.prepare(w, a.workdir, a.steps, 1)
    run_dir = os.path.join(a.workdir, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ["RAY_worker_niceness"] = "0"
    Trainer(compose_mgrpo(g.mgrpo_overrides({**base, "run_dir": run_dir}) + a.overrides)).fit()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="qwen3vocab")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed)")
    ap.add_argument("--out", default=None, help="JSON with every call's row (default: print only)")
    ap.add_argument("--trace-ms", type=float, default=0,
                    help="also sample the rank's RSS every this many ms with the calls running then (0: off); "
                         "prints the largest samples, and the JSON keeps the trace")
    ap.add_argument("overrides", nargs="*", help="extra mgrpo-train overrides")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        return child(a)
    if a.trace_ms < 0:
        ap.error(f"--trace-ms must be >= 0 (0: off), got {a.trace_ms}")
    tmp = tempfile.mkdtemp(prefix="rank-memory-")
    a.workdir = a.workdir or os.path.join(tmp, "work")
    with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    rows_path = os.path.join(tmp, "calls.jsonl")
    from benchmarks.peers.grpo_workloads import child_pythonpath
    from benchmarks.tools.proctree import machine

    env = dict(os.environ, RANK_MEMORY_OUT=rows_path, TOKENIZERS_PARALLELISM="false")
    if a.trace_ms:
        env["RANK_MEMORY_TRACE_MS"] = str(a.trace_ms)
    env["PYTHONPATH"] = os.pathsep.join([tmp, child_pythonpath(env)])
    load0 = os.getloadavg()
    cmd = [sys.executable, "-m", "benchmarks.measure.rank_memory", "--_child", "--workload", a.workload, "--prompts",
           str(a.prompts), "--steps", str(a.steps), "--workdir", a.workdir, *a.overrides]
    subprocess.run(cmd, env=env, check=True)
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f]
    print(f"{'call':34} {'s':>7} {'RSS before':>10} {'peak':>7} {'after':>7} {'anon':>7} {'PSS after':>9}")
    for r in rows:
        print(f"{'  ' * r['depth'] + r['call']:34} {r['seconds']:7.2f} {r['rss_before_mib']:10} {r['peak_rss_mib']:7} "
              f"{r['rss_after_mib']:7} {r['anon_after_mib']:7} {r['pss_after_mib']:9}")
    trace = []
    if a.trace_ms and os.path.exists(rows_path + ".trace"):
        with open(rows_path + ".trace") as f:
            trace = [json.loads(line) for line in f]
        print("\nlargest RSS samples (s since the rank's actor module loaded; calls running, by thread):")
        for s in sorted(trace, key=lambda s: -s["rss_mib"])[:8]:
            print(f"  t={s['t']:8.2f}s  RSS {s['rss_mib']:6} MiB  {' | '.join(' > '.join(v) for v in s['calls'].values())}")
    if a.out:
        m = machine()
        m.update(loadavg_at_start=load0, loadavg_at_end=os.getloadavg())
        argv_shown = sys.argv[1:] if argv is None else argv
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(["python", "-m", "benchmarks.measure.rank_memory", *argv_shown]),
                       "machine": m,
                       "units": "MiB of the rank process (RSS from /proc/self/status, PSS from smaps_rollup)",
                       "calls": rows, **({"trace": trace} if trace else {})}, f, indent=1)
        print(f"wrote {a.out}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
