"""How fast weights reach a rollout server over each transport, on this machine (CPU).

    python -m benchmarks.measure.weight_sync_bench [--presets tiny qwen3-0.6b] [--bucket-mb 256] [--syncs 3]

For each preset, a randomly initialised model of that architecture (transformers' init, seeded) is
written as an HF checkpoint and served by the CPU rollout server (`SGLangEngine.launch`, a
subprocess, exactly as the rollout group starts it). This process plays the trainer's source rank:
it holds the HF-named tensors, cut into buckets of --bucket-mb (`bucketize`, as the trainer does),
and runs --syncs full syncs per transport, each one `begin` + every bucket + `finish_weight_update`
(end of session, version, cache flush):
  - tensor:      TensorWeightSender -> /update_weights_from_tensor, flattened bucket in named shared
                 memory (the colocated path; CUDA IPC on GPU);
  - distributed: DistributedWeightSender -> /update_weights_from_distributed, one gloo broadcast per
                 bucket over loopback TCP (the disaggregated path; NCCL on GPU);
and, as the yardstick, one plain memory copy of the same number of bytes (torch copy_ between two
preallocated buffers). Seconds are the median of the syncs. After the last sync the server's
weights are checked (greedy log-probs against this process's model, which must agree).
Results: benchmarks/results/weight_sync_cpu.{csv,json}. A benchmark reports numbers; it asserts
nothing beyond that check.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, output_path
from benchmarks.measure.convert_bench import machine


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_preset(preset: str, bucket_mb: int, syncs: int, work: str) -> list[dict]:
    import torch
    import yaml
    from safetensors.torch import load_file

    from mgrpo.config import ModelConfig
    from mgrpo.models import bucketize, init_hf_checkpoint
    from mgrpo.rollout.sglang import DistributedWeightSender, SGLangEngine, TensorWeightSender
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    with open(os.path.join(REPO, "configs", "model", preset + ".yaml")) as f:
        cfg = ModelConfig(**yaml.safe_load(f))
    hf_dir = os.path.join(work, preset)
    t0 = time.perf_counter()
    init_hf_checkpoint(hf_dir, cfg, seed=0)
    print(f"{preset}: random init + save {time.perf_counter() - t0:.1f} s", flush=True)
    named = {}
    for fn in sorted(os.listdir(hf_dir)):
        if fn.endswith(".safetensors"):
            named.update(load_file(os.path.join(hf_dir, fn)))
    names = sorted(named)
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    t0 = time.perf_counter()
    engine = SGLangEngine.launch(hf_dir, host="127.0.0.1", startup_timeout_s=600, log_dir=os.path.join(work, "logs"),
                                 enable_memory_saver=False)
    print(f"{preset}: server up in {time.perf_counter() - t0:.1f} s ({nbytes / 1e9:.3f} GB of weights)", flush=True)
    rows = []
    version = 0
    try:
        senders = {"tensor": TensorWeightSender([engine.url], 1),
                   "distributed": DistributedWeightSender([engine.url], [1], master_address="127.0.0.1",
                                                          timeout_s=600)}
        for transport, sender in senders.items():
            times = []
            for k in range(syncs):
                version += 1
                # new values every sync, made before the clock starts: the trainer has them already
                scale = 1.0 + 0.01 * version
                current = [(n, named[n] * scale) for n in names]
                buckets = list(bucketize(current, bucket_mb << 20))
                t0 = time.perf_counter()
                for b in buckets:
                    sender.update_weights(b)
                engine.finish_weight_update(version)
                times.append(time.perf_counter() - t0)
                print(f"{preset} {transport} sync {k + 1}: {times[-1]:.3f} s", flush=True)
            sec = statistics.median(times)
            rows.append({"preset": preset, "transport": transport, "bytes": nbytes, "tensors": len(names),
                         "buckets": len(buckets), "bucket_mb": bucket_mb, "syncs": syncs,
                         "seconds_median": round(sec, 6),
                         "seconds_all": [round(t, 4) for t in times], "gb_s": round(nbytes / 1e9 / sec, 3)})
        senders["distributed"].close()
        # the server holds the last sync's weights: its greedy log-probs must match a local forward
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(named[n] * (1.0 + 0.01 * version))
            prompt = [1, 2, 3]
            out = engine.generate([GenerateRequest(uid=0, prompt_ids=prompt)],
                                  SamplingParams(temperature=0.0, max_new_tokens=4))[0]
            lp = torch.log_softmax(ref(torch.tensor([prompt + out.token_ids])).logits[0, 2:-1].float(), -1)
            diff = float((lp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
                          - torch.tensor(out.logprobs)).abs().max())
        print(f"{preset}: server vs local log-prob max |diff| after {version} syncs: {diff:.2e}", flush=True)
    finally:
        engine.shutdown()
    copy = memcpy_seconds(nbytes, 3)
    rows.append({"preset": preset, "transport": "memcpy", "bytes": nbytes, "tensors": len(names), "buckets": 1,
                 "bucket_mb": None, "syncs": 3, "seconds_median": round(copy, 6), "seconds_all": None,
                 "gb_s": round(nbytes / 1e9 / copy, 3)})
    for r in rows:
        r["logprob_max_abs_diff_after_last_sync"] = diff
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "qwen3-0.6b"])
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--syncs", type=int, default=3)
    add_output_args(p, "weight_sync_cpu")
    p.add_argument("--workdir", default=None, help="scratch space (several GB); default a temporary directory")
    args = p.parse_args(argv)
    args.out = output_path(args, "weight_sync_cpu")
    info = machine()
    work = args.workdir or tempfile.mkdtemp(prefix="weight_sync_bench_")
    rows = []
    for preset in args.presets:
        rows += run_preset(preset, args.bucket_mb, args.syncs, work)
    for r in rows:
        print(f"{r['preset']:>11} {r['transport']:>11}: {r['bytes'] / 1e6:9.1f} MB in {r['seconds_median']:.4f} s "
              f"= {r['gb_s']:.3f} GB/s")
    info["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": "python -m benchmarks.measure.weight_sync_bench " + " ".join(argv or sys.argv[1:]),
                   "machine": info, "dtype": "float32", "rows": rows}, f, indent=2)
    with open(args.out + ".csv", "w", newline="") as f:
        cols = [k for k in rows[0] if k != "seconds_all"]
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}.csv and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
