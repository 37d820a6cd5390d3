"""What each way of bounding the decode loop's heap costs in time: the CPU engines' decode loop (rollout/decode.py)
on the qwen3vocab model.

    python -m benchmarks.measure.decode_heap            # 32 rows x 48 tokens, 3 calls per setting, settings alternated
    python -m benchmarks.measure.decode_heap --rows 32 --tokens 128 --rounds 2

Settings, each in a fresh process with one malloc arena (what a Megatron rank has, mgrpo/heap.py):
- `adaptive`: glibc's own mmap threshold (raised to each freed mapped block's size, up to 32 MiB), the loop's
  trims turned off;
- `trim16`:   the same, with malloc_trim every 16 decode steps, what the CPU engines do;
- `mmap4mib`: `MALLOC_MMAP_THRESHOLD_=4MiB`, every block of 4 MiB or more a mapping of its own.
Per setting: the calls' wall time, the process's minor page faults, and its RSS growth at the peak. The heap's
fragmentation itself shows in a rank (rank_memory.py --trace-ms), not here: this process allocates nothing between
the decode steps. Writes benchmarks/results/decode_heap_cpu.json (or --out). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import add_output_args, output_path

SETTINGS = {"adaptive": {}, "trim16": {}, "mmap4mib": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}}

CHILD = r"""
import json, sys, time, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from mgrpo.rollout import decode
rows, tokens, calls, trim = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.set_num_threads(1)
torch.manual_seed(0)
# the qwen3vocab workload's model (benchmarks/peers/grpo_workloads.py: QWEN3VOCAB_MODEL)
cfg = Qwen3Config(vocab_size=151936, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, intermediate_size=768, tie_word_embeddings=True,
                  max_position_embeddings=2048)
model = Qwen3ForCausalLM(cfg).eval()
ids = torch.randint(0, 151000, (rows, 150))
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))
def minflt():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])
if not trim:
    decode.trim_heap = lambda: None
times, f0, base = [], minflt(), status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
for _ in range(calls):
    t0 = time.perf_counter()
    with torch.no_grad():
        decode.decode(model, [decode.Req(rid=str(i), input_ids=row, max_new_tokens=tokens, ignore_eos=True)
                              for i, row in enumerate(ids.tolist())], pad_id=151643, stop_ids={151645})
    times.append(time.perf_counter() - t0)
print(json.dumps({"call_s": times, "minor_faults": minflt() - f0, "peak_growth_mib": status("VmHWM") - base}))
"""


def run(setting: str, a) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(MALLOC_ARENA_MAX="1", **SETTINGS[setting])
    out = subprocess.run([sys.executable, "-c", CHILD, str(a.rows), str(a.tokens), str(a.calls),
                          "1" if setting == "trim16" else "0"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--calls", type=int, default=3, help="generate calls per process")
    ap.add_argument("--rounds", type=int, default=2, help="processes per setting, the settings alternated")
    add_output_args(ap, "decode_heap_cpu.json")
    a = ap.parse_args(argv)
    a.out = output_path(a, "decode_heap_cpu.json")
    load0 = os.getloadavg()
    got: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(a.rounds):
        for s in SETTINGS:
            got[s].append(run(s, a))
            print(f"round {r} {s:9}: calls {[round(t, 2) for t in got[s][-1]['call_s']]} s, "
                  f"{got[s][-1]['minor_faults']:,} minor faults, peak +{got[s][-1]['peak_growth_mib']:.0f} MiB",
                  flush=True)
    summary = {s: {"median_call_s": round(statistics.median(t for g in runs for t in g["call_s"]), 3),
                   "minor_faults_per_process": round(statistics.median(g["minor_faults"] for g in runs)),
                   "peak_growth_mib": round(max(g["peak_growth_mib"] for g in runs))} for s, runs in got.items()}
    base = summary["adaptive"]["median_call_s"]
    for s, v in summary.items():
        v["time_vs_adaptive"] = round(v["median_call_s"] / base, 3)
        print(f"{s:9}: median call {v['median_call_s']:.2f} s ({v['time_vs_adaptive']:.2f}x), "
              f"{v['minor_faults_per_process']:,} minor faults per process")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(["python", "-m", "benchmarks.measure.decode_heap",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "rows": a.rows, "tokens": a.tokens, "calls": a.calls, "rounds": a.rounds,
                   "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(), "summary": summary, "runs": got},
                  f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
