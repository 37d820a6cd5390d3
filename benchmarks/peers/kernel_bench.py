"""Benchmark forward+backward of the GRPO loss over an output layer: naive vs chunked vs Triton vs Liger.

    python -m benchmarks.peers.kernel_bench --T 4096 --H 1024 --V 151936 --dtype fp32
    python -m benchmarks.peers.kernel_bench --T 1024 --impls chunked --support none,topk:50,nucleus:0.3   # supports

Writes outputs/benchmarks/kernel_cpu.{csv,json} (untracked) or --out; the committed results the README is
rendered from (benchmarks/results/kernel_cpu.*) change only with --update-results.

It lives here, not in kernels/: the kernels are loss-agnostic (they run whatever token loss they are
handed) and this measures them with the loss production trains with, mgrpo.algorithms' (the kernel room
may not import the algorithms room: tests/repo/test_architecture.py).

`gemm` is the floor, not a loss: the three bare GEMMs of the same shapes (logits = h @ W^T,
dHidden = dz @ W, dWeight = dz^T @ h, with the logits standing in for dz), no softmax, no loss.
An implementation that raises (e.g. runs out of memory) gets a row with its error and no time.

All implementations see the same inputs and the same loss (PPO clip 0.2/0.2, k3 KL to the
reference with coef 0.001, token-mean over all tokens; ours also computes the entropy, which Liger
does not offer). They run interleaved, round-robin with a rotating order, after one warm-up round,
so a machine that gets busier or cooler mid-run penalises everyone alike. Reported per impl: median
time, peak extra memory, and on GPU model TFLOP/s (6*T*H*V: one GEMM forward, two backward) as a
fraction of the card's dense bf16 peak.

Peak extra memory on CPU is the kernel's own high-water mark of resident memory (VmHWM, reset
before each call through /proc/self/clear_refs) minus the resident size just before the call:
exact, no sampling thread that could miss a short peak. It is honest for tensors because glibc
serves allocations above 32 MB with mmap and returns them to the OS on free, so RSS follows the
live big tensors. Where clear_refs is not writable, a 1 ms sampling thread over RSS is used instead.
Peaks include the returned grads (dWeight is V*H*4 bytes) since every implementation makes them.
On GPU: torch.cuda.max_memory_allocated minus the allocation before the call.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import platform
import statistics
import threading
import time
from importlib import metadata
from pathlib import Path

import torch

from benchmarks import add_output_args, output_path
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn
from mgrpo.config import AlgorithmConfig
from mgrpo_kernels import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK, capabilities, fused_linear_loss

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by substring of the device name.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H800": 989.0, "A100": 312.0,
                    "A800": 312.0, "B200": 2250.0, "L40S": 362.0, "L40": 181.0, "A10G": 70.0, "RTX 4090": 165.0}
KL_COEF, CLIP = 0.001, 0.2


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class PeakMemory:
    """Peak extra bytes during a block of code (see the module docstring for the method)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0
        self.use_hwm = device.type == "cpu" and os.access("/proc/self/clear_refs", os.W_OK)

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            if self.use_hwm:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
            self.base = _rss_kb("VmRSS") * 1024
            self.sampled, self.stop = self.base, threading.Event()
            if not self.use_hwm:
                self.thread = threading.Thread(target=self._sample, daemon=True)
                self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.001):
            self.sampled = max(self.sampled, _rss_kb("VmRSS") * 1024)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.use_hwm:
            self.peak = _rss_kb("VmHWM") * 1024 - self.base
        else:
            self.stop.set()
            self.thread.join()
            self.peak = self.sampled - self.base


def make_inputs(T, H, V, dtype, device, seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * 0.5).to(device=device, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(device=device, dtype=dtype)
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    old_lp = (torch.randn(T, generator=g) * 0.1 - 12.0).to(device)  # ~log(1/V): random-init policy
    ref_lp = old_lp + 0.05 * torch.randn(T, generator=g).to(device)
    adv = torch.randn(T // seq_len, generator=g).repeat_interleave(seq_len).to(device)  # one per sequence
    return dict(hidden=hidden, weight=weight, labels=labels, old_lp=old_lp, ref_lp=ref_lp, adv=adv)


def make_support(labels, V, spec: str, seed=0):
    """CSR supports for --support: 'topk:K' (K ids per token) or 'nucleus:F' (a fraction F of the
    vocabulary), random ids that include the token's label. Random ids are the worst case for the
    kernel's per-chunk union (a real model's neighbouring tokens share candidates)."""
    kind, _, val = spec.partition(":")
    if kind not in ("topk", "nucleus") or not val:
        raise SystemExit(f"--support {spec!r}: expected topk:K or nucleus:F")
    k = int(val) if kind == "topk" else max(1, int(float(val) * V))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lab in labels.tolist():
        ids = torch.randperm(V, generator=g)[:k]
        if not bool((ids == lab).any()):
            ids[0] = lab
        rows.append(ids.sort().values)
    offsets = torch.arange(len(rows) + 1, dtype=torch.long) * k
    return offsets.to(labels.device), torch.cat(rows).to(labels.device)


def make_runners(x, args, impls):
    """impl name -> callable returning the loss after forward+backward (grads land in .grad)."""
    # The loss production trains with (the kernel itself is loss-agnostic).
    T = x["hidden"].shape[0]
    weights = torch.full((T,), 1.0 / T, device=x["hidden"].device)

    def loss_fn(support):
        # old/ref log-probs at the level of a random-init policy over the support (log 1/k, not log 1/V)
        shift = 0.0 if support is None else math.log(args.V / int(support[0][1] - support[0][0]))
        return make_token_loss_fn(
            TokenLossInputs(old_logprob=x["old_lp"] + shift, advantages=x["adv"], token_weight=weights,
                            metric_weight=weights, ref_logprob=x["ref_lp"] + shift),
            AlgorithmConfig(clip_ratio_low=CLIP, clip_ratio_high=CLIP, use_kl_loss=True, kl_loss_type="k3",
                            kl_coef=KL_COEF, entropy_coeff=0.0))  # Liger's GRPO loss has no entropy term
    ours = dict(chunk_size=args.chunk_size, vocab_chunk_size=args.vocab_chunk_size,
                compute_entropy=not args.no_entropy)
    supports = x.get("supports", {None: None})  # --support spec -> CSR (offsets, ids); None: full vocabulary
    runners = {}
    for impl in impls:
        if impl in ("naive", "chunked", "fused"):
            for spec, sup in supports.items():
                kw = ours if sup is None else dict(ours, support_offsets=sup[0], support_ids=sup[1])

                def run(h, w, impl=impl, kw=kw, fn=loss_fn(sup)):
                    loss = fused_linear_loss(h, w, x["labels"], fn, impl=impl, **kw)[0]
                    loss.backward()
                    return loss
                runners[impl if spec is None else f"{impl}@{spec}"] = run
        elif None not in supports:
            raise ImportError(f"{impl} runs over the full vocabulary only: add 'none' to --support")
        elif impl == "gemm":
            def run(h, w):
                z = h.detach() @ w.detach().T  # [T, V] logits, reused as dLogits
                torch.mm(z, w.detach())  # dHidden [T, H]
                torch.mm(z.T, h.detach())  # dWeight [V, H]
                return z.new_zeros((), dtype=torch.float32)
            runners[impl] = run
        elif impl in ("liger", "liger_eager"):
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            B = T // args.liger_seq
            liger = LigerFusedLinearGRPOLoss(beta=KL_COEF, epsilon_low=CLIP, epsilon_high=CLIP, loss_type="dapo",
                                             compiled=args.liger_compile and impl == "liger",
                                             chunk_size=args.liger_chunk)
            shape = (B, args.liger_seq)

            def run(h, w):
                loss = liger(h.view(B, args.liger_seq, -1), w, x["labels"].view(shape),
                             torch.ones(shape, device=h.device), x["adv"].view(shape)[:, 0].contiguous(),
                             ref_per_token_logps=x["ref_lp"].view(shape), old_per_token_logps=x["old_lp"].view(shape))[0]
                loss.backward()
                return loss
            runners[impl] = run
        else:
            raise SystemExit(f"unknown impl {impl!r}")
    return runners


def machine(device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "device": str(device)}
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
        info["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, StopIteration, ValueError):
        pass
    for pkg in ("triton", "liger-kernel"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def bf16_peak(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", default=None,
                    help="comma list of naive,chunked,fused,liger,liger_eager,gemm (default: all usable but gemm)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-seconds-per-impl", type=float, default=None,
                    help="stop timing an impl once its calls took this long in all (it keeps >= 1 timed call)")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="tokens per chunk (chunked path)")
    ap.add_argument("--vocab-chunk-size", type=int, default=DEFAULT_VOCAB_CHUNK, help="vocab rows per tile (chunked)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-entropy", action="store_true", help="skip the entropy in our implementations")
    ap.add_argument("--liger-seq", type=int, default=512,
                    help="tokens per sequence (advantages are per sequence; Liger takes [B, S, H])")
    ap.add_argument("--liger-chunk", type=int, default=1, help="Liger chunk_size (sequences per chunk)")
    ap.add_argument("--liger-compile", action="store_true",
                    help="let Liger torch.compile its loss math (impl liger; liger_eager never compiles)")
    ap.add_argument("--support", default=None,
                    help="comma list of per-token sampling supports to run our impls with: none (the full "
                         "vocabulary), topk:K, nucleus:F (random ids with the label); default none")
    add_output_args(ap, "kernel_cpu.csv")  # and .json beside it
    return ap.parse_args(argv)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(args) -> tuple[list[dict], dict]:
    """Run the benchmark described by `args` (see parse_args); return (rows, meta). Prints per call."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    impls = args.impls.split(",") if args.impls else (
        ["naive", "chunked"] + (["fused"] if capabilities()["fused"] and device.type == "cuda" else []) + ["liger"])

    if args.T % args.liger_seq:
        raise SystemExit(f"--T {args.T} must be a multiple of --liger-seq {args.liger_seq}")
    load_at_start = os.getloadavg()  # other users of the machine skew CPU timings: recorded in the JSON
    x = make_inputs(args.T, args.H, args.V, dtype, device, args.liger_seq)
    if args.support:
        x["supports"] = {None if spec == "none" else spec: None if spec == "none" else
                         make_support(x["labels"], args.V, spec) for spec in args.support.split(",")}
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    runners, errors = {}, {}
    for impl in impls:
        try:
            runners.update(make_runners(x, args, [impl]))
        except ImportError as e:  # e.g. Liger not installed
            errors[impl] = f"not available: {type(e).__name__}: {e}"
    impls = list(runners) + [impl for impl in impls if impl in errors]  # one name per (impl, support)
    times = {k: [] for k in impls}
    peaks = {k: [] for k in impls}
    spent = {k: 0.0 for k in impls}
    losses = {}
    for rnd in range(args.warmup + args.repeats):
        order = impls[rnd % len(impls):] + impls[: rnd % len(impls)]  # rotate: no impl always goes first
        for impl in order:
            if impl in errors:
                continue
            if (args.max_seconds_per_impl is not None and times[impl]
                    and spent[impl] >= args.max_seconds_per_impl):
                continue  # over its time budget, with at least one timed call
            h.grad = w.grad = None
            try:
                with PeakMemory(device) as mem:
                    t0 = time.perf_counter()
                    loss = runners[impl](h, w)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001  (an OOM of one impl must not end the others' run)
                errors[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                h.grad = w.grad = None
                loss = None
                _free(device)
                print(f"  round {rnd} {impl:8s} failed: {errors[impl]}", flush=True)
                continue
            spent[impl] += dt
            losses[impl] = float(loss.detach())
            del loss
            if rnd >= args.warmup:
                times[impl].append(dt)
                peaks[impl].append(mem.peak)
            print(f"  round {rnd} {impl:8s} {dt:8.3f} s  peak +{mem.peak / 2**20:9.1f} MiB", flush=True)
    h.grad = w.grad = None
    del x, h, w
    _free(device)

    flops, peak_tf = 6.0 * args.T * args.H * args.V, bf16_peak(device)
    base_t = statistics.median(times["naive"]) if times.get("naive") else None
    base_m = max(peaks["naive"]) if peaks.get("naive") else None
    rows = []
    for impl in impls:
        row = {"impl": impl, "T": args.T, "H": args.H, "V": args.V, "dtype": args.dtype, "device": str(device),
               "threads": torch.get_num_threads(), "chunk_size": args.chunk_size,
               "vocab_chunk_size": args.vocab_chunk_size,
               "entropy": impl not in ("liger", "liger_eager", "gemm") and not args.no_entropy,
               "support": impl.partition("@")[2] or "none",
               "repeats": len(times[impl])}
        if not times[impl]:
            rows.append({**row, "error": errors.get(impl, "no timed call")})
            continue
        t, m = statistics.median(times[impl]), max(peaks[impl])
        tflops = flops / t / 1e12
        rows.append({**row, "median_s": round(t, 4), "min_s": round(min(times[impl]), 4),
                     "max_s": round(max(times[impl]), 4), "peak_extra_mib": round(m / 2**20, 1),
                     "time_vs_naive": round(t / base_t, 3) if base_t else None,
                     "mem_vs_naive": round(m / base_m, 4) if base_m else None,
                     "model_tflops": round(tflops, 3),
                     "frac_bf16_peak": round(tflops / peak_tf, 4) if peak_tf else None,
                     "loss": None if impl == "gemm" else losses[impl]})
    meta = {"machine": machine(device), "args": vars(args), "memory_method": (
        "cuda max_memory_allocated" if device.type == "cuda" else
        "VmHWM reset via /proc/self/clear_refs" if PeakMemory(device).use_hwm else "1 ms RSS sampling"),
        "flops_per_step": flops, "bf16_peak_tflops": peak_tf, "loadavg_at_start": load_at_start,
        "loadavg_at_end": os.getloadavg(), "errors": errors,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return rows, meta


def main(argv=None):
    args = parse_args(argv)
    rows, meta = measure(args)
    print(f"\nT={args.T} H={args.H} V={args.V} {args.dtype} on {args.device}, median of {args.repeats}")
    print(f"{'impl':20s} {'median s':>9s} {'x naive':>8s} {'peak MiB':>10s} {'x naive':>8s} {'TFLOP/s':>8s} "
          f"{'loss':>12s}")
    def cell(value, width: int, spec: str) -> str:  # '-' where there is nothing to compare with (naive not run)
        return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"

    for r in rows:
        if "error" in r:
            print(f"{r['impl']:20s} {r['error']}")
            continue
        print(f"{r['impl']:20s} {r['median_s']:9.3f} {cell(r['time_vs_naive'], 8, '.3f')} "
              f"{r['peak_extra_mib']:10.1f} {cell(r['mem_vs_naive'], 8, '.4f')} "
              f"{r['model_tflops']:8.3f} {cell(r['loss'], 12, '.6f')}")
    out = Path(output_path(args, "kernel_cpu.csv"))
    fields: list = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
