"""What one rollout generate call costs the CPU engines at Qwen3's vocabulary: time and peak extra memory of
`HFRolloutEngine.generate` (the in-process engine, rollout=hf_cpu) and `CPUModel.generate` (the model side of the
SGLang-protocol CPU server), as the working tree has them and as an earlier commit had them.

    python -m benchmarks.measure.engine_logprob_memory --before 50f15eb  # 16 rows x 128 tokens, qwen3vocab model
    python -m benchmarks.measure.engine_logprob_memory --rows 8 --tokens 32 --out /tmp/engines

Each (engine, version) runs in a fresh process: the engine is built from a seeded random Qwen3 checkpoint of the
qwen3vocab workload's shape (benchmarks/peers/grpo_workloads.py), warmed up with one short call, then one timed call
generates --rows responses to GSM8K-length prompts (--prompt-len tokens) of exactly --tokens tokens (EOS is never
sampled: the model is random). Peak extra memory is the process's high-water mark of resident memory during the
call minus its resident size before (VmHWM reset through /proc/self/clear_refs:
`benchmarks/peers/kernel_bench.py`'s PeakMemory).
The earlier version is the engine module read from git at --before, imported under another name.
Outputs <out>.csv and <out>.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO, add_output_args, output_path
from benchmarks.gpu.common import write_csv
from benchmarks.peers.grpo_workloads import WORKLOADS, make_initial_model
from benchmarks.tools.proctree import machine

MODULES = {"hf": "mgrpo/rollout/hf_engine.py", "sglang_cpu": "mgrpo/rollout/sglang/cpu/model.py"}


def load_module(engine: str, rev: str | None, scratch: str):
    path = os.path.join(REPO, MODULES[engine])
    if rev:
        src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{MODULES[engine]}"], capture_output=True, text=True,
                             check=True).stdout
        path = os.path.join(scratch, f"{engine}_{rev}.py")
        with open(path, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location(f"engine_{engine}_{rev or 'tree'}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def measure_one(engine: str, rev: str | None, ckpt: str, rows: int, tokens: int, prompt_len: int, scratch: str) -> dict:
    import torch

    from benchmarks.peers.kernel_bench import PeakMemory

    torch.set_num_threads(1)
    mod = load_module(engine, rev, scratch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 100000, (prompt_len - (i % 8),), generator=g).tolist() for i in range(rows)]
    if engine == "hf":
        from mgrpo.rollout.types import GenerateRequest, SamplingParams

        eng = mod.HFRolloutEngine(ckpt, eos_token_ids=[151645], pad_token_id=151643)

        def call(n_rows, n_tok):
            reqs = [GenerateRequest(uid=i, prompt_ids=p) for i, p in enumerate(prompts[:n_rows])]
            return eng.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=n_tok, seed=1))
    else:
        eng = mod.CPUModel(ckpt)

        def call(n_rows, n_tok):
            return eng.generate([mod.Req(rid=str(i), input_ids=p, max_new_tokens=n_tok, seed=i, ignore_eos=True)
                                 for i, p in enumerate(prompts[:n_rows])])
    call(2, 2)  # warm-up
    with PeakMemory(torch.device("cpu")) as mem:
        t0 = time.perf_counter()
        out = call(rows, tokens)
        dt = time.perf_counter() - t0
    lps = [lp for r in out for lp in (r.logprobs if engine == "hf" else r.logprobs)]
    return {"engine": engine, "version": rev or "working tree", "rows": rows, "tokens": tokens,
            "prompt_len": prompt_len, "seconds": round(dt, 3), "peak_extra_mib": round(mem.peak / 2**20, 1),
            "generated_tokens": sum(len(r.token_ids if engine == "hf" else r.out) for r in out),
            "mean_logprob": round(sum(lps) / len(lps), 6), "loadavg": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None, help="git revision of the earlier engines (default: only the tree)")
    ap.add_argument("--engines", default="hf,sglang_cpu")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=120)
    add_output_args(ap, "engine_logprob_memory")
    ap.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.out = output_path(a, "engine_logprob_memory")
    if a._one:
        engine, rev, ckpt = a._one
        print(json.dumps(measure_one(engine, None if rev == "-" else rev, ckpt, a.rows, a.tokens, a.prompt_len,
                                     os.path.dirname(ckpt))))
        return
    meta = {"command": " ".join(["python", "-m", "benchmarks.measure.engine_logprob_memory"] + sys.argv[1:]),
            "machine": machine(), "model": WORKLOADS["qwen3vocab"].model_label()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine_mem-") as tmp:
        ckpt = os.path.join(tmp, "init_hf")
        make_initial_model(WORKLOADS["qwen3vocab"], ckpt)
        for engine in a.engines.split(","):
            for rev in ([a.before] if a.before else []) + ["-"]:
                cmd = [sys.executable, "-m", "benchmarks.measure.engine_logprob_memory", "--rows", str(a.rows),
                       "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len), "--_one", engine, rev, ckpt]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                if p.returncode != 0:
                    row = {"engine": engine, "version": rev, "error": p.stderr.strip().splitlines()[-1][:300]}
                else:
                    row = json.loads(p.stdout.strip().splitlines()[-1])
                print(row, flush=True)
                rows.append(row)
    meta["loadavg_at_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    write_csv(Path(a.out + ".csv"), rows)
    with open(a.out + ".json", "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}.csv and {a.out}.json")


if __name__ == "__main__":
    main()
