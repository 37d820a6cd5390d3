"""Part 2: the kernel benchmark at Qwen3-8B's output layer, through benchmarks/peers/kernel_bench.py.

GPU: H=4096, V=151,936, bf16, T in {4096, 16384} timed (1 warm-up + 3 rounds, interleaved) and
T=32768 for memory only (one call each). Implementations: ours (fused = Triton, chunked = torch),
naive full logits, Liger's fused linear GRPO loss (compiled, as Liger runs by default, and eager)
when liger-kernel imports, and `gemm`: the three bare cuBLAS GEMMs of the same shapes, the floor.
Each row: median time, model TFLOP/s (6*T*H*V / time), fraction of the card's dense bf16 peak
(by device name), peak extra memory; an implementation that fails (out of memory) gets its error.
kernel_bench.json adds the ratios ours/Liger and ours/bare-GEMMs at T=16384.

Dry run (CPU): the same code path at tiny shapes in fp32 (Triton under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu.common import Skip, bootstrap, check, importable, part, part_args, write_csv, write_json

bootstrap()

import torch  # noqa: E402

from benchmarks.peers import kernel_bench as bench  # noqa: E402
from mgrpo_kernels import capabilities  # noqa: E402

GPU_PLAN = dict(H=4096, V=151936, dtype="bf16", liger_seq=512, ratio_T=16384,
                runs=[(4096, "timing", 1, 3, 20.0), (16384, "timing", 1, 3, 30.0), (32768, "memory_only", 0, 1, None)])
DRY_PLAN = dict(H=16, V=128, dtype="fp32", liger_seq=16, ratio_T=64,
                runs=[(32, "timing", 1, 1, None), (64, "timing", 1, 1, None), (128, "memory_only", 0, 1, None)])
OURS, PEERS = ("fused", "chunked"), ("liger", "liger_eager", "gemm")


def ratios(rows: list[dict], T: int) -> dict:
    """time(ours) / time(peer) at T: below 1 means ours is faster."""
    t = {r["impl"]: r["median_s"] for r in rows if r.get("T") == T and r.get("median_s")}
    return {f"{o}/{p}": round(t[o] / t[p], 3) for o in OURS for p in PEERS if o in t and p in t}


def main(argv=None):
    args = part_args(__doc__.split("\n\n")[0]).parse_args(argv)
    out = Path(args.out)
    with part("bench", out) as rec:
        gpu = args.mode == "gpu"
        if gpu and not torch.cuda.is_available():
            raise Skip("mode gpu but no CUDA device")
        plan = GPU_PLAN if gpu else DRY_PLAN
        impls = ["naive", "chunked"] + (["fused"] if capabilities()["fused"] else [])
        if importable("liger_kernel"):
            impls += ["liger", "liger_eager"] if gpu else ["liger_eager"]  # compiling on CPU costs minutes
        else:
            rec["result"]["liger"] = "not available (liger-kernel is not installed; carry its wheel, see README)"
        impls.append("gemm")
        device_name = torch.cuda.get_device_name(0) if gpu else "cpu"
        rows, metas = [], {}
        for T, purpose, warmup, repeats, cap in plan["runs"]:
            print(f"T={T} ({purpose})", flush=True)
            argv_b = ["--T", str(T), "--H", str(plan["H"]), "--V", str(plan["V"]), "--dtype", plan["dtype"],
                      "--device", "cuda" if gpu else "cpu", "--impls", ",".join(impls), "--warmup", str(warmup),
                      "--repeats", str(repeats), "--liger-seq", str(plan["liger_seq"])]
            if gpu:
                argv_b.append("--liger-compile")
            if cap:
                argv_b += ["--max-seconds-per-impl", str(cap)]
            b_rows, meta = bench.measure(bench.parse_args(argv_b))
            for r in b_rows:
                rows.append({"purpose": purpose, "gpu": device_name, **r})
            metas[str(T)] = meta
            write_csv(out / "kernel_bench.csv", rows)  # after every T: a part killed later keeps these rows
        if "liger" in rec["result"]:
            rows.append({"impl": "liger", "error": rec["result"]["liger"]})
            write_csv(out / "kernel_bench.csv", rows)
        rec["files"].append("kernel_bench.csv")

        # Every implementation computes the same loss on the same inputs (gemm computes none).
        for T in {r["T"] for r in rows if "T" in r}:
            losses = {r["impl"]: r["loss"] for r in rows if r.get("T") == T and r.get("loss") is not None}
            base = losses.get("naive", losses.get("chunked"))
            for impl, v in losses.items():
                if base is not None:
                    check(rec, f"T{T}/{impl}/loss_vs_naive", abs(v - base), 1e-3 * abs(base) + 1e-4)
        for r in rows:
            if r.get("impl") in OURS and r.get("T") is not None:
                check(rec, f"T{r['T']}/{r['impl']}/ran", 0.0 if "error" not in r else 1.0, 0.0)
        T = plan["ratio_T"]
        at = {r["impl"]: r for r in rows if r.get("T") == T and r.get("median_s")}
        rec["result"].update(
            device=device_name, bf16_peak_tflops=metas[str(T)]["bf16_peak_tflops"], ratio_T=T,
            time_ratios_at_ratio_T=ratios(rows, T),
            tflops_at_ratio_T={k: v["model_tflops"] for k, v in at.items()},
            frac_bf16_peak_at_ratio_T={k: v["frac_bf16_peak"] for k, v in at.items()},
            peak_extra_mib={f"T{r['T']}/{r['impl']}": r.get("peak_extra_mib", r.get("error"))
                            for r in rows if r.get("T") is not None},
            goal_600_tflops_met=bool(gpu and at.get("fused", {}).get("model_tflops", 0.0) >= 600.0),
            best_ours_tflops=max((at[o]["model_tflops"] for o in OURS if o in at), default=None),
            median_s_at_ratio_T={k: v["median_s"] for k, v in at.items()},
        )
        write_json(out / "kernel_bench_runs.json", metas)
        rec["files"].append("kernel_bench_runs.json")
        print("ratios at T=%d: %s" % (T, rec["result"]["time_ratios_at_ratio_T"]), flush=True)
        if not gpu:
            rec["result"]["note"] = "dry run: CPU timings at toy shapes, meaningless as performance numbers"


if __name__ == "__main__":
    main()
