"""The planner's CPU memory estimate against the measured peak of the real Megatron actor.

    python -m benchmarks.measure.plan_memory_cpu         # every case that fits this machine
    python -m benchmarks.measure.plan_memory_cpu --cases tiny-tp1pp1 tiny-moe-ep2

Each case runs MegatronActor (mgrpo/training/actor.py) on its gloo ranks (tp x pp, x 2 data-parallel
ranks for the mixture-of-experts case at expert-parallel size 2) spawned by
mgrpo/training/spawn.py (no Ray), fp32 on CPU, through one step's phases: build (weights, fp32 gradient
buffer, reference), old-policy and reference log-probs, one optimizer step on a mini-batch of
max-length sequences, and the weight-sync iteration (buckets built, sent nowhere). Per rank the peak
resident memory (VmHWM) above a baseline is read after each phase: the baseline is the RSS once
torch, megatron-core and mgrpo are imported, and the peak is reset to the current RSS
(/proc/self/clear_refs) before the first phase. The planner (mgrpo.plan.memory.estimate_stages)
estimates the same config; results go to benchmarks/results/plan_vs_measured_cpu.{csv,json}.
A benchmark reports numbers; tests/plan/test_plan_memory.py asserts the agreement on the fast cases.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time

from benchmarks import add_output_args, output_path

MIB = 1024**2
PHASES = ("build", "logprobs", "train", "sync")

# name -> (model preset, overrides). Sequences are all max-length; the token budget sets the micro-batch.
TINY_LONG = ["data.max_prompt_length=192", "data.max_response_length=64", "actor.max_tokens_per_gpu=4096",
             "data.train_batch_size=8", "rollout.n=4", "model.max_position_embeddings=256"]
CASES = {
    # tiny: the default job's model with long sequences, so activations (not the process) dominate
    **{f"tiny-tp{tp}pp{pp}": ("tiny", [f"actor.tp={tp}", f"actor.pp={pp}", *TINY_LONG])
       for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))},
    # the tiny MoE (8 experts, top-2) on the same batch: at EP 2 two data-parallel ranks split the batch and
    # every layer's experts
    **{f"tiny-moe-ep{ep}": ("tiny-moe", [f"actor.ep={ep}", *TINY_LONG]) for ep in (1, 2)},
    # Qwen3-0.6B: 0.6B parameters, 151,936-token vocabulary (weights and Adam states dominate); no
    # reference model (algorithm.use_kl_loss=false) so that two pipeline stages fit this 24 GiB machine
    **{f"qwen3-0.6b-tp{tp}pp{pp}": ("qwen3-0.6b", [f"actor.tp={tp}", f"actor.pp={pp}", "data.max_prompt_length=192",
                                                   "data.max_response_length=64", "actor.max_tokens_per_gpu=256",
                                                   "data.train_batch_size=2", "rollout.n=2",
                                                   "algorithm.use_kl_loss=false"])
       for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))},
}


def case_config(name: str, extra: tuple = ()):
    """The case's config on the fewest ranks its layout needs (tp x pp, or what actor.ep needs)."""
    from mgrpo_launchers.plan import compose_config

    preset, overrides = CASES[name]
    return compose_config([f"model={preset}", "trainer.device=cpu", "trainer.logger=[console]", *overrides, *extra])


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM <- VmRSS (Linux >= 4.0)


def rank_batch(cfg):
    """This rank's share of a mini-batch: every sample at the maximum prompt and response length."""
    from mgrpo.config import layout
    from mgrpo.training.batch import RankBatch

    d, a = cfg.data, cfg.actor
    n = (a.ppo_mini_batch_size or d.train_batch_size) * cfg.rollout.n // layout(cfg).dp
    p, r = d.max_prompt_length, d.max_response_length
    ids = [[(i * 7 + j) % cfg.model.vocab_size for j in range(p + r)] for i in range(n)]
    tokens = n * r
    return RankBatch(input_ids=ids, prompt_lens=[p] * n, seq_index=list(range(n)),
                     advantages=[[1.0 if i % 2 else -1.0] * r for i in range(n)], old_logprobs=[[-2.0] * r] * n,
                     ref_logprobs=[[-2.0] * r] * n, token_weight=[[1.0 / tokens] * r] * n, metric_weight=1.0 / tokens)


def _measure_rank(rank, world, port, cfg, hf_dir):
    # Everything a Megatron rank imports, before the baseline: the actor's construction reaches
    # transformers (config checks) and megatron's DDP/optimizer/schedules, whose code pages are
    # part of the process, not of the plan.
    import megatron.core.distributed  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401

    import mgrpo.models.hf_checkpoint  # noqa: F401
    import mgrpo.models.weight_iter  # noqa: F401
    from mgrpo.training.actor import MegatronActor

    batch = rank_batch(cfg)
    baseline, _ = _rss()
    _reset_peak()
    peaks, times = {}, {}

    def phase(name, fn):
        t0 = time.perf_counter()
        fn()
        peaks[name] = _rss()[1] - baseline
        times[name] = time.perf_counter() - t0

    holder = {}
    phase("build", lambda: holder.setdefault("a", MegatronActor(
        cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, init_hf_dir=hf_dir,
        total_steps=1, need_ref=cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)))
    actor = holder["a"]
    phase("logprobs", lambda: [actor.compute_logprobs(batch, which) for which in ("actor", "ref")[:1 + bool(actor.ref)]])
    phase("train", lambda: actor.train_mini_batch(batch))
    phase("sync", lambda: actor.sync_weights([], cfg.rollout.update_weights_bucket_mb << 20))
    info = {"pp_rank": actor.ctx.pp_rank, "tp_rank": actor.ctx.tp_rank, "ep_rank": actor.ctx.ep_rank,
            "baseline": baseline}
    actor.shutdown()
    return {**info, "peaks": peaks, "seconds": times}


# glibc's malloc serves a freed block's size from its heap from then on (the mmap threshold follows the
# largest freed block, up to 32 MiB), and freed heap memory stays resident: RSS then holds freed
# activations too. A fixed threshold (what MALLOC_MMAP_THRESHOLD_ sets) returns every block of 64 KiB
# or more to the kernel when freed, so RSS follows the live tensors, which is what the planner counts.
MALLOC_ENV = {"default": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}}


def measure(name: str, work: str, extra: tuple = (), malloc: str = "mmap") -> list[dict]:
    """Run one case; per rank the peak above baseline after each phase, and the planner's estimate.
    `malloc`: 'mmap' (RSS follows live tensors) or 'default' (glibc's defaults, what a run gets)."""
    from mgrpo.plan.memory import estimate_stages
    from mgrpo.config import layout
    from mgrpo.models import init_hf_checkpoint
    from mgrpo.training.spawn import spawn_ranks

    cfg = case_config(name, extra)
    a = cfg.actor
    hf_dir = os.path.join(work, cfg.model.name.replace("/", "_") + "-init")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        init_hf_checkpoint(hf_dir, cfg.model, seed=1)
    saved = {k: os.environ.get(k) for k in MALLOC_ENV["mmap"]}
    os.environ.update(MALLOC_ENV[malloc])  # read by glibc when each spawned rank starts
    try:
        results = spawn_ranks(_measure_rank, layout(cfg).megatron_world, cfg, hf_dir, timeout_s=1800, threads=1)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    stages = estimate_stages(cfg)
    rows = []
    for rank, res in enumerate(results):
        rows.append(row(name, cfg, rank, res["pp_rank"], res["tp_rank"], res["baseline"], res["peaks"],
                        sum(res["seconds"].values()), stages, malloc))
    return rows


def row(name, cfg, rank, pp_rank, tp_rank, baseline, peaks, seconds, stages, malloc) -> dict:
    a = cfg.actor
    measured = max(peaks.values())
    return {"case": name, "malloc": malloc, "model": cfg.model.name, "tp": a.tp, "pp": a.pp, "ep": a.ep, "rank": rank,
            "pp_rank": pp_rank, "tp_rank": tp_rank, "micro_batch_tokens": stages[pp_rank].shape.tokens,
            "baseline_mib": round(baseline / MIB, 1),
            **{f"measured_{p}_mib": round(peaks[p] / MIB, 1) for p in PHASES},
            "measured_peak_mib": round(measured / MIB, 1),
            **estimate_columns(stages[pp_rank], measured / MIB), "seconds": round(seconds, 1)}


def estimate_columns(est, measured_mib: float) -> dict:
    return {"estimated_peak_mib": round(est.peak / MIB, 1), "estimated_peak_phase": est.peak_phase,
            "estimated_persistent_mib": round(sum(est.terms[k] for k in (
                "actor_weights", "actor_grads", "optimizer_states", "reference_weights")) / MIB, 1),
            "estimated_activations_mib": round(est.terms["activations"] / MIB, 1),
            "estimate_over_measured": round(est.peak / MIB / measured_mib, 3)}


def row_fields(r: dict) -> list:
    """A row's columns with ep after pp (older rows got it appended)."""
    keys = [k for k in r if k != "ep"]
    return keys[:keys.index("pp") + 1] + ["ep"] + keys[keys.index("pp") + 1:]


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def main() -> None:
    from benchmarks.tools.proctree import machine

    from mgrpo.plan.memory import estimate_stages
    from mgrpo.config import layout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--malloc", nargs="*", default=["mmap", "default"], choices=list(MALLOC_ENV))
    add_output_args(parser, "plan_vs_measured_cpu")
    parser.add_argument("--reestimate", action="store_true",
                        help="measure nothing: recompute the estimate columns of the stored rows with this planner")
    args = parser.parse_args()
    args.out = output_path(args, "plan_vs_measured_cpu")
    # Results accumulate: a run replaces the rows of the cases and malloc modes it measured.
    old = json.load(open(args.out + ".json")) if os.path.exists(args.out + ".json") else {"rows": [], "skipped": []}
    if args.reestimate:
        for r in old["rows"]:
            r.update(estimate_columns(estimate_stages(case_config(r["case"]))[r["pp_rank"]], r["measured_peak_mib"]))
        args.cases = []
    done = {(c, m) for c in args.cases for m in args.malloc}
    rows = [r for r in old["rows"] if (r["case"], r["malloc"]) not in done]
    skipped = [x for x in old.get("skipped", []) if (x["case"], x["malloc"]) not in done]
    with tempfile.TemporaryDirectory() as work:
        for name in args.cases:
            cfg = case_config(name)
            # every rank of the case + 2 GiB for the parent and the shared machine
            need = layout(cfg).megatron_world // cfg.actor.pp * sum(st.peak for st in estimate_stages(cfg)) + 2 * 1024**3
            for malloc in args.malloc:
                if need > available_memory():
                    reason = (f"needs ~{need / 1024**3:.1f} GiB (planner, all ranks + 2 GiB), "
                              f"{available_memory() / 1024**3:.1f} GiB available")
                    print(f"{name} ({malloc}): skipped: {reason}", flush=True)
                    skipped.append({"case": name, "malloc": malloc, "reason": reason})
                    continue
                t0 = time.perf_counter()
                got = measure(name, work, malloc=malloc)
                rows += got
                worst = max(got, key=lambda r: abs(r["estimate_over_measured"] - 1))
                print(f"{name} ({malloc}): measured peak {max(r['measured_peak_mib'] for r in got):.1f} MiB, estimate "
                      f"{max(r['estimated_peak_mib'] for r in got):.1f} MiB, worst rank ratio "
                      f"{worst['estimate_over_measured']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows.sort(key=lambda r: (list(CASES).index(r["case"]), r["malloc"], r["rank"]))
    for r in rows:  # rows measured before expert parallelism existed
        r.setdefault("ep", 1)
    fields = list(dict.fromkeys(k for r in rows for k in row_fields(r)))
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    run = {"command": "python -m benchmarks.measure.plan_memory_cpu " + " ".join(sys.argv[1:]),
           "machine": machine(packages=("torch", "megatron-core", "psutil"))}
    if args.reestimate:
        run["note"] = "estimate columns recomputed by the planner of this commit; measured columns from earlier runs"
    runs = old.get("runs", []) + [run]
    with open(args.out + ".json", "w") as f:
        json.dump({"runs": runs, "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
