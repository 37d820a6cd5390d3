"""torch's AdamW on CPU, by implementation: what the actor's optimizer step costs (training/optim.py).

    python -m benchmarks.measure.adamw                   # the Qwen3-vocabulary model's 42M fp32 parameters
    python -m benchmarks.measure.adamw --update-results  # benchmarks/results/adamw_cpu.json

megatron falls back to `torch.optim.AdamW` without TE or apex and leaves torch's default, for CPU tensors the
single-tensor loop; mgrpo sets the fused kernel (`use_fused_torch_adam`). Each implementation in a fresh process
(2 threads, one malloc arena as a rank has): the median of `--steps` timed steps after one warm-up step, and the
peak RSS growth during them over the RSS after the warm-up (the moments exist by then). Also the largest
difference of the parameters from the single-tensor loop's after the same steps. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks import add_output_args, output_path

IMPLS = ("single", "foreach", "fused")

CHILD = r"""
import ctypes, json, resource, sys, time, torch
impl, steps = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
torch.manual_seed(0)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
# the qwen3vocab model's shapes (benchmarks/peers/grpo_workloads.py): the tied 151,936 x 256 embedding and ~3.2M
# of body parameters, in one tensor here
params = [torch.nn.Parameter(torch.randn(151936, 256)), torch.nn.Parameter(torch.randn(3_200_000))]
grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01,
                        **({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}))
for p, g in zip(params, grads[0]):
    p.grad = g
opt.step()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base, times = rss(), []
for i in range(steps):
    for p, g in zip(params, grads[i % 2]):
        p.grad = g
    t0 = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
torch.save([p.detach() for p in params], sys.argv[3])
print(json.dumps({"step_s": times, "peak_growth_mib": peak - base}))
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    add_output_args(ap, "adamw_cpu.json")
    a = ap.parse_args(argv)
    a.out = output_path(a, "adamw_cpu.json")
    load0 = os.getloadavg()
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    got, finals = {}, {}
    for impl in IMPLS:
        path = f"{a.out}.{impl}.pt"
        out = subprocess.run([sys.executable, "-c", CHILD, impl, str(a.steps), path], env=env, capture_output=True,
                             text=True, check=True)
        got[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        finals[impl] = path
    import torch

    ref = torch.load(finals["single"])
    summary = {}
    for impl in IMPLS:
        mine = torch.load(finals[impl])
        times = sorted(got[impl]["step_s"])
        summary[impl] = {"median_step_s": round(times[len(times) // 2], 4),
                         "peak_growth_mib": round(got[impl]["peak_growth_mib"], 1),
                         "max_abs_diff_vs_single": max((x - y).abs().max().item() for x, y in zip(mine, ref))}
        os.remove(finals[impl])
        print(f"{impl:8}: median step {summary[impl]['median_step_s']:.3f} s, peak +{summary[impl]['peak_growth_mib']:.0f}"
              f" MiB, max |diff| vs single {summary[impl]['max_abs_diff_vs_single']:.2e}")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(["python", "-m", "benchmarks.measure.adamw",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "steps": a.steps, "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
                   "torch_version": torch.__version__, "summary": summary, "runs": got}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
