"""LoRA against full fine-tuning on one CPU Megatron rank: bytes per weight sync and the rank's peak memory, and
the planner's LoRA table for the Qwen3 GPU presets.

    python -m benchmarks.measure.lora                      # tiny and qwen3vocab, 3 steps each
    python -m benchmarks.measure.lora --update-results     # benchmarks/results/lora_cpu.json

Each (workload, LoRA on/off) runs in a fresh process: the real MegatronActor (fp32, one rank) on the workload's
model shape (benchmarks/peers/grpo_workloads.py), a random batch of the workload's size, and the CPU rollout
server on the same checkpoint (launched as the rollout group launches it, with SGLang's LoRA arguments), then
per step one optimizer step (`train_mini_batch`) and the weight syncs, both to that server through the real
client: the full sync (every base weight through /update_weights_from_tensor; with LoRA base + alpha/r * B @ A
merged in, actor.lora.sync=merged) and, with LoRA, the adapter-only sync (the PEFT tensors through
/load_lora_adapter_from_tensors under a new name, the old one unloaded, actor.lora.sync=adapter). Per step: the
bytes and seconds of each sync as the client sent them, and the rank's peak RSS over the reference forward and
the optimizer step (VmHWM, reset through /proc/self/clear_refs at its start, read before the syncs, whose staging
buffers are the client's; the server is another process). The planner rows come from
`mgrpo-plan`'s own function (launchers/plan.py::build_plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import socket
import tempfile
import time

from benchmarks import add_output_args, write_json

LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["all-linear"]}
SAMPLES = {"tiny": (256, 8, 4), "qwen3vocab": (16, 150, 128)}
"""workload -> (samples per step, prompt tokens, response tokens): tiny is the main job's 32 prompts x 8 samples;
qwen3vocab 16 GSM8K-length samples (its 64 per step, cut for this shared 2-core machine)."""
PLAN_PRESETS = {
    "Qwen3-8B": ["recipe=qwen3-8b-gsm8k-grpo"],
    "Qwen3-30B-A3B": ["recipe=qwen3-8b-gsm8k-grpo", "model=qwen3-30b-a3b", "actor.ep=8", "actor.tp=1"],
}


def _status() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f)
                if k in ("VmRSS", "VmHWM")}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(hf_dir: str, log_dir: str):
    from mgrpo.rollout.sglang import SGLangEngine

    return SGLangEngine.launch(hf_dir, host="127.0.0.1", server="cpu", log_dir=log_dir, startup_timeout_s=600,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               extra_args=["--enable-lora", "--max-lora-rank", str(LORA["rank"]),
                                           "--lora-target-modules", "all"])


def _model_cfg(workload: str):
    from benchmarks.peers.grpo_workloads import WORKLOADS
    from mgrpo.config import MGRPOConfig

    fields = dict(WORKLOADS[workload].model)
    return dataclasses.replace(MGRPOConfig().model, name=workload, **fields)


def _run(workload: str, lora: bool, hf_dir: str, steps: int, out):
    import torch

    from mgrpo.config import MGRPOConfig
    from mgrpo.config.schema import LoraConfig
    from mgrpo.models.peft_export import peft_config
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch

    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, model=_model_cfg(workload),
                              actor=dataclasses.replace(cfg.actor, lora=LoraConfig(**LORA) if lora else LoraConfig(),
                                                        lr=5e-3 if lora else 5e-4),
                              trainer=dataclasses.replace(cfg.trainer, device="cpu"))
    torch.set_num_threads(1)
    actor = MegatronActor(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=_port(),
                          init_hf_dir=hf_dir, total_steps=steps, need_ref=True)
    n, p, r = SAMPLES[workload]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.model.vocab_size, (p + r,), generator=g).tolist() for _ in range(n)]
    batch = RankBatch(input_ids=ids,
                      prompt_lens=[p] * n, seq_index=list(range(n)),
                      advantages=[torch.randn(r, generator=g).tolist() for _ in range(n)],
                      token_weight=[[1.0 / (n * r)] * r for _ in range(n)], metric_weight=1.0 / (n * r))
    rows = []
    engine = _engine(hf_dir, tempfile.mkdtemp(prefix="mgrpo-lora-measure-"))
    try:
        for step in range(steps):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status()["VmRSS"]
            actor.compute_logprobs(batch, "ref", keep=True)  # the reference forward, as a step with a KL term
            actor.train_mini_batch(batch)
            peak = _status()["VmHWM"]
            t0, sent0 = time.perf_counter(), engine.stats["weight_bytes"]
            actor.sync_weights([engine], bucket_bytes=64 << 20)
            engine.finish_weight_update(step + 1)
            full_s, full = time.perf_counter() - t0, engine.stats["weight_bytes"] - sent0
            adapter, adapter_s = 0, 0.0
            if lora:
                t0 = time.perf_counter()
                tensors = actor.peft_tensors()
                config = peft_config(tensors, cfg.actor.lora, hf_dir)
                adapter = engine.use_lora_adapter(f"v{step + 1}", tensors, config, step + 1)
                adapter_s = time.perf_counter() - t0
            rows.append({"step": step + 1, "full_sync_bytes": full, "full_sync_s": round(full_s, 4),
                         "adapter_sync_bytes": adapter, "adapter_sync_s": round(adapter_s, 4),
                         "rss_before_mib": round(before), "peak_rss_mib": round(peak)})
    finally:
        engine.shutdown()
    trainable = sum(q.numel() for q in actor.gpt.parameters() if q.requires_grad)
    actor.shutdown()
    out.put({"workload": workload, "lora": lora, "trainable_params": trainable, "steps": rows,
             "samples": n, "prompt_tokens": p, "response_tokens": r})


def _plan_rows() -> dict:
    from mgrpo_launchers.plan import build_plan, compose_config

    out = {}
    for name, overrides in PLAN_PRESETS.items():
        plan = build_plan(compose_config([*overrides, f"actor.lora.rank={LORA['rank']}",
                                          f"actor.lora.alpha={LORA['alpha']}"]))
        mem = plan["memory_per_accelerator"]
        out[name] = {"layout": {k: plan["trainer"][k] for k in ("tp", "pp", "ep", "dp")}, **mem["lora"]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(SAMPLES))
    parser.add_argument("--steps", type=int, default=3)
    add_output_args(parser, "lora_cpu")
    args = parser.parse_args(argv)
    from mgrpo.models import init_hf_checkpoint

    ctx = mp.get_context("spawn")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.workloads:
            hf = init_hf_checkpoint(os.path.join(tmp, w), _model_cfg(w), seed=1)
            for lora in (False, True):
                q = ctx.Queue()
                proc = ctx.Process(target=_run, args=(w, lora, hf, args.steps, q))
                proc.start()
                runs.append(q.get(timeout=1800))
                proc.join(timeout=60)
    for r in runs:
        for s in r["steps"]:
            print(f"{r['workload']:<11} lora={str(r['lora']):<5} step {s['step']}: full sync "
                  f"{s['full_sync_bytes'] / 2**20:8.2f} MiB in {s['full_sync_s']:.3f}s, adapter sync "
                  f"{s['adapter_sync_bytes'] / 2**20:7.3f} MiB in {s['adapter_sync_s']:.3f}s, "
                  f"peak RSS {s['peak_rss_mib']} MiB")
    plan = _plan_rows()
    for name, row in plan.items():
        print(f"plan {name} {row['layout']}: LoRA rank {row['rank']} "
              f"{row['adapter_params_per_rank']:,} adapter params/GPU")
        for k in row["lora"]:
            print(f"  {k:<20} LoRA {row['lora'][k] / 2**30:8.2f} GiB   full {row['full'][k] / 2**30:8.2f} GiB")
    write_json(args, "lora_cpu", {"lora": LORA, "runs": runs, "plan": plan,
                                  "note": "bytes and seconds as the client sent them to the CPU server: full_sync "
                                          "(/update_weights_from_tensor, merged with LoRA), adapter_sync "
                                          "(/load_lora_adapter_from_tensors, LoRA only)"})


if __name__ == "__main__":
    main()
