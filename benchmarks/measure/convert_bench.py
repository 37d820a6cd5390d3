"""How fast Qwen3 weights move between HF and Megatron layouts on this machine.

    python -m benchmarks.measure.convert_bench [--preset qwen3-0.6b] [--tp 1 2] [--bucket-mb 256] [--repeats 3]

A randomly initialised model of the preset's architecture (transformers' init, seeded) is written
as an HF checkpoint, then for each TP size (PP=1, gloo ranks on CPU):
  - load_hf_into_megatron (each rank reads its slices of the safetensors),
  - the weight-sync path: bucketize(iter_megatron_to_hf(...)) consumed to the end, which gathers
    TP shards and rebuilds HF tensors (best of --repeats); at TP=1 it hands out views of the
    parameters, so it is also timed with every bucket copied into one flat buffer (what a sender
    does before a transfer), and at TP>1 against the bare gloo all_gathers of the same shards,
  - save_megatron_checkpoint (megatron distributed checkpoint) and, at TP=1, save_hf_checkpoint,
and, as the yardstick, one plain memory copy of the same number of bytes (torch copy_ between two
preallocated buffers, best of --repeats). Results go to benchmarks/results/convert_cpu.{csv,json}
with the machine they came from. A benchmark reports numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, output_path


def machine() -> dict:
    import megatron.core
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(mem_gb, 1), "gpu": "none",
            "python": platform.python_version(), "torch": torch.__version__, "megatron_core": megatron.core.__version__,
            "transformers": transformers.__version__, "os": platform.platform(),
            # the machine is shared: other jobs' load skews every number here
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}


def _rank(rank, world_size, port, cfg, hf_dir, work, bucket_bytes, repeats, write_hf):
    import torch
    import torch.distributed as dist

    from mgrpo.models import (bucketize, iter_megatron_to_hf, load_hf_into_megatron, save_hf_checkpoint,
                              save_megatron_checkpoint)
    from mgrpo.models.gpt import build_gpt_model, transformer_config
    from mgrpo.models.qwen3 import hf_shapes
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    tp = world_size
    ctx = init_parallel(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, tp=tp, pp=1)
    tf = transformer_config(cfg, tp=tp, use_cpu=True)
    model = build_gpt_model(cfg, tf, pre_process=True, post_process=True, pg_collection=ctx.pg_collection)
    out = {"threads_per_rank": torch.get_num_threads()}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        return time.perf_counter() - t0, result

    out["load_s"], _ = timed(lambda: load_hf_into_megatron(model, hf_dir, cfg, tp_rank=ctx.tp_rank, tp_size=tp,
                                                           pp_rank=0, pp_size=1))

    def sync():
        nbytes = tensors = buckets = 0
        named = iter_megatron_to_hf(model, cfg, tp_group=ctx.tp_group, tp_size=tp, pp_rank=0, pp_size=1)
        for bucket in bucketize(named, bucket_bytes):
            buckets += 1
            tensors += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        return nbytes, tensors, buckets

    runs = [timed(sync) for _ in range(repeats)]
    out["iter_s"] = min(s for s, _ in runs)
    out["iter_all_s"] = [round(s, 4) for s, _ in runs]
    out["bytes"], out["tensors"], out["buckets"] = runs[0][1]

    # The same stream, each bucket copied into one flat buffer, as a sender does before a transfer
    # (at TP=1 the iterator itself hands out views of the parameters and copies almost nothing).
    largest = max(math.prod(shape) for shape in hf_shapes(cfg).values()) * 4  # a tensor above bucket_bytes
    flat = torch.empty(max(bucket_bytes, largest), dtype=torch.uint8)

    def sync_and_flatten():
        named = iter_megatron_to_hf(model, cfg, tp_group=ctx.tp_group, tp_size=tp, pp_rank=0, pp_size=1)
        for bucket in bucketize(named, bucket_bytes):
            offset = 0
            for _, t in bucket:
                n = t.numel() * t.element_size()
                flat[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
                offset += n

    out["iter_flatten_s"] = min(timed(sync_and_flatten)[0] for _ in range(repeats))

    if tp > 1:
        # The communication floor: one all_gather per sharded parameter, nothing converted.
        sharded = [p for n, p in model.named_parameters() if "norm" not in n]

        def gather_only():
            for p_ in sharded:
                parts = [torch.empty_like(p_) for _ in range(tp)]
                dist.all_gather(parts, p_.detach(), group=ctx.tp_group)

        out["gather_floor_s"] = min(timed(gather_only)[0] for _ in range(repeats))

    out["save_megatron_s"], _ = timed(lambda: save_megatron_checkpoint(model, os.path.join(work, f"mcore_tp{tp}")))
    if write_hf:
        named = iter_megatron_to_hf(model, cfg, tp_group=ctx.tp_group, tp_size=tp, pp_rank=0, pp_size=1)
        out["save_hf_s"], _ = timed(lambda: save_hf_checkpoint(os.path.join(work, "hf_out"), named, cfg))
    destroy_parallel()
    return out


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    import yaml

    from mgrpo.config import ModelConfig
    from mgrpo.models import init_hf_checkpoint
    from mgrpo_launchers.convert import spawn_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    add_output_args(p, "convert_cpu")
    p.add_argument("--workdir", default=None, help="scratch space (several GB); default a temporary directory")
    args = p.parse_args(argv)
    args.out = output_path(args, "convert_cpu")

    with open(os.path.join(REPO, "configs", "model", args.preset + ".yaml")) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    work = args.workdir or tempfile.mkdtemp(prefix="convert_bench_")
    hf_dir = os.path.join(work, "hf")
    t0 = time.perf_counter()
    init_hf_checkpoint(hf_dir, cfg, seed=0)
    init_s = time.perf_counter() - t0
    hf_bytes = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    print(f"{args.preset}: random init + save_hf_checkpoint {init_s:.1f} s, {hf_bytes / 1e9:.2f} GB of safetensors")

    info = machine()
    rows = []
    for tp in args.tp:
        res = spawn_ranks(_rank, tp, cfg, hf_dir, work, args.bucket_mb << 20, args.repeats, tp == 1)[0]
        copy_s = memcpy_seconds(res["bytes"], args.repeats)
        gb = res["bytes"] / 1e9
        row = {"preset": args.preset, "dtype": "float32", "tp": tp, "pp": 1, "bucket_mb": args.bucket_mb,
               "bytes": res["bytes"], "tensors": res["tensors"], "buckets": res["buckets"],
               "iter_s": round(res["iter_s"], 4), "iter_gb_s": round(gb / res["iter_s"], 3),
               "memcpy_s": round(copy_s, 4), "memcpy_gb_s": round(gb / copy_s, 3),
               "iter_vs_memcpy": round(res["iter_s"] / copy_s, 2),
               "iter_flatten_s": round(res["iter_flatten_s"], 4),
               "iter_flatten_gb_s": round(gb / res["iter_flatten_s"], 3),
               "iter_flatten_vs_memcpy": round(res["iter_flatten_s"] / copy_s, 2),
               "gloo_gather_floor_s": round(res["gather_floor_s"], 4) if "gather_floor_s" in res else "",
               "load_hf_s": round(res["load_s"], 3), "load_hf_gb_s": round(gb / res["load_s"], 3),
               "save_megatron_s": round(res["save_megatron_s"], 3),
               "save_hf_s": round(res["save_hf_s"], 3) if "save_hf_s" in res else "",
               "init_hf_s": round(init_s, 2), "threads_per_rank": res["threads_per_rank"], **info}
        rows.append(row)
        print(f"tp={tp}: memcpy of the same {gb:.2f} GB {row['memcpy_s']} s = {row['memcpy_gb_s']} GB/s; "
              f"bucketed iterator {row['iter_s']} s = {row['iter_gb_s']} GB/s (x{row['iter_vs_memcpy']} memcpy); "
              f"iterator + flatten buckets {row['iter_flatten_s']} s = {row['iter_flatten_gb_s']} GB/s "
              f"(x{row['iter_flatten_vs_memcpy']})"
              + (f"; gloo all_gather floor {row['gloo_gather_floor_s']} s" if tp > 1 else "")
              + f"; load HF {row['load_hf_s']} s; save megatron {row['save_megatron_s']} s"
              + (f"; save HF {row['save_hf_s']} s" if row["save_hf_s"] != "" else ""))

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(args.out + ".json", "w") as f:
        json.dump({"machine": info, "command": " ".join(["python", "-m", "benchmarks.measure.convert_bench",
                                                         *(argv or sys.argv[1:])]), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}.csv and {args.out}.json")
    if not args.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
