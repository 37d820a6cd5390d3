"""GPU checks in one command: kernel correctness, kernel benchmark, megatron training step + rollout,
and the Transformer Engine / FP8 step, each writing CSV/JSON with its status.

    python -m benchmarks.gpu.run                       # on a CUDA machine: writes benchmarks/results/gpu/
    python -m benchmarks.gpu.run --out /tmp/x          # anywhere else
    python -m benchmarks.gpu.run --dry-run             # tiny CPU forms of every part (no CUDA needed)

Without a CUDA device the command says so and runs the dry run (fp32, tiny shapes, Triton under
TRITON_INTERPRET=1) into a fresh temporary folder unless --out is given. Each part is its own
process with a time cap, so a crash, a CUDA fault or a hang in one part is recorded in its JSON and
the next part runs. See benchmarks/gpu/README.md for the files and their columns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.gpu.common import REPO, describe_machine, write_json

# part -> (module, extra args, time cap on GPU s, time cap in the dry run s)
PARTS = {
    "kernels": ("benchmarks.gpu.kernel_check", [], 100, 120),
    "bench": ("benchmarks.gpu.kernel_bench", [], 240, 180),
    "train": ("benchmarks.gpu.train_check", ["--part", "train"], 150, 240),
    "te": ("benchmarks.gpu.train_check", ["--part", "te"], 120, 120),
}
RESERVE_S = 20  # kept for every later part when an earlier one may run to its cap


_print_lock = threading.Lock()


def run_part(name: str, mode: str, out: Path, work: Path, cap: float, env: dict) -> dict:
    module, extra, _, _ = PARTS[name]
    cmd = [sys.executable, "-m", module, "--out", str(out), "--mode", mode, *extra]
    if module.endswith("train_check"):
        cmd += ["--work", str(work)]
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)  # never report a previous run's result as this one's
    log_path = out / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _print_lock:
        print(f"\n=== {name} (cap {cap:.0f} s): {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    timed_out = threading.Event()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own group: a timeout ends its rank processes too

        def kill():
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(cap, kill)
        timer.start()
        for line in proc.stdout:
            log.write(line)
            if not any(w in line for w in ("warnings.warn(", "UserWarning", "DeprecationWarning")):
                with _print_lock:
                    sys.stdout.write(f"  {name} | " + line)
                    sys.stdout.flush()
        proc.wait()
        timer.cancel()
    seconds = round(time.perf_counter() - t0, 1)
    if result_file.exists() and not timed_out.is_set():
        rec = json.loads(result_file.read_text())
    else:
        tail = log_path.read_text()[-3000:]
        rec = {"part": name, "status": "timeout" if timed_out.is_set() else "error",
               "error": (f"killed after the {cap:.0f} s cap" if timed_out.is_set()
                         else f"exited {proc.returncode} without writing {result_file.name}"), "log_tail": tail}
        write_json(result_file, rec)  # the part's own JSON, for the next reader, says what happened
    rec["wall_s"] = seconds
    rec["log"] = str(log_path.relative_to(out))
    return rec


def headline(rec: dict) -> str:
    r = rec.get("result", {})
    if rec["status"] in ("skipped", "error", "timeout"):
        return (rec.get("reason") or rec.get("error") or "")[:160]
    if rec["part"] == "kernels":
        return "; ".join(f"{k}: lp {v['lp_err']:.1e} gradW {v['gw_rel']:.1e}"
                         for k, v in r.get("max_errors", {}).items() if not k.endswith("/naive"))
    if rec["part"] == "bench":
        tf = ", ".join(f"{k} {v}" for k, v in r.get("tflops_at_ratio_T", {}).items())
        return f"T={r.get('ratio_T')}: TFLOP/s {tf}; time ratios {r.get('time_ratios_at_ratio_T')}"
    if rec["part"] in ("train", "te"):
        a, b, u = (r.get(k, {}) for k in ("step0_logprobs_rollout_vs_trainer", "step0_logprobs_device_vs_cpu_fp32",
                                          "update"))
        return (f"step-0 |lp| rollout-trainer max {a.get('max_abs', float('nan')):.2e}, device-cpu max "
                f"{b.get('max_abs', float('nan')):.2e}; update cosine {u.get('cosine', float('nan')):.4f}"
                + (f"; shims {list(r['shims'])}" if r.get("shims") else ""))
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/gpu on a GPU, a new "
                                                "temp folder in the dry run)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="the tiny CPU forms even where CUDA is present")
    ap.add_argument("--budget-s", type=float, default=570.0, help="total time for all parts (caps shrink to fit)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch folder (HF checkpoint, batch)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="parts run side by side (default: 1 on a GPU, where timings need the card alone; 2 in the "
                         "dry run). Part te always follows part train: it reuses train's batch and CPU reference")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; expected a comma list of {list(PARTS)}")

    import torch

    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if torch.cuda.is_available() and not args.dry_run:
        mode = "gpu"
        env.pop("TRITON_INTERPRET", None)
        # (the device's name comes from the parts: asking for it here would hold a CUDA context all run long)
        print(f"CUDA available ({torch.cuda.device_count()} device(s)): running the GPU checks", flush=True)
    else:
        mode = "dry-run"
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        why = "--dry-run given" if args.dry_run else "no CUDA device found (torch.cuda.is_available() is False)"
        print(f"{why}: DRY RUN, tiny CPU forms of every part (fp32, Triton under TRITON_INTERPRET=1); "
              "the numbers are not GPU results", flush=True)
    out = Path(args.out) if args.out else (REPO / "benchmarks/results/gpu" if mode == "gpu"
                                           else Path(tempfile.mkdtemp(prefix="mgrpo-gpu-dryrun-")))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mgrpo-gpu-work-"))
    print(f"results: {out}", flush=True)

    jobs = args.jobs or (1 if mode == "gpu" else 2)
    t_start, done = time.perf_counter(), {}

    def lane(names: list[str]) -> None:
        for i, name in enumerate(names):
            left = args.budget_s - (time.perf_counter() - t_start) - RESERVE_S * (len(names) - i - 1)
            cap = min(PARTS[name][2 if mode == "gpu" else 3], max(left, 30.0))
            done[name] = run_part(name, mode, out, work, cap, env)

    if jobs == 1:
        lane(parts)
    else:  # train (then te) in one lane, the kernel parts in the other
        lanes = [[p for p in parts if p in ("train", "te")], [p for p in parts if p not in ("train", "te")]]
        threads = [threading.Thread(target=lane, args=(ln,)) for ln in lanes if ln]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    records = [done[p] for p in parts]
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)

    summary = {"mode": mode, "machine": describe_machine() if mode == "gpu" else {**describe_machine(), "mode": mode},
               "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu.run", *(argv or sys.argv[1:])]),
               "total_s": round(time.perf_counter() - t_start, 1),
               "parts": {r["part"]: {k: r.get(k) for k in ("status", "wall_s", "reason", "error", "failed_checks",
                                                           "files", "log")} | {"headline": headline(r)}
                         for r in records}}
    write_json(out / "summary.json", summary)
    print(f"\n{'part':8s} {'status':8s} {'s':>6s}  headline", flush=True)
    for r in records:
        print(f"{r['part']:8s} {r['status']:8s} {r['wall_s']:6.1f}  {headline(r)}")
    print(f"total {summary['total_s']} s; wrote {out}/summary.json", flush=True)
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
