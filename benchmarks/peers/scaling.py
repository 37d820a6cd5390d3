"""How mgrpo's cost grows as one factor of the work grows and the rest stay fixed (and TRL's, where it runs).

    python -m benchmarks.peers.scaling --quick          # 2-3 points per factor (kernel 3 min, vocab 11 min at load 10-40)
    python -m benchmarks.peers.scaling                  # every point (not timed here: hours on 2 cores)
    python -m benchmarks.peers.scaling --factors kernel,vocab  # some factors only

Factors (each a CSV + PNG under benchmarks/results/, scaling_<factor>.{csv,png}, and all of them in scaling.json):
- length:  response tokens (max_new_tokens) 64 -> 1024; mgrpo and TRL
- vocab:   vocabulary 16 -> 151,936 (the synthetic `sum` prompts, which every vocabulary can encode); mgrpo and TRL
- prompts: prompts per step (x 8 samples); mgrpo and TRL
- ranks:   Megatron ranks over gloo: TP 1, 2, 4 and DP 2, 4; mgrpo
- engines: SGLang-protocol CPU servers, 1 or 2 behind SGLang's router; mgrpo
- kernel:  the log-prob kernel's working memory and time against tokens T at fixed H=256, V=151,936:
           full logits (naive) vs the chunked kernel (benchmarks/peers/kernel_bench.py's measurement, forward +
           backward)

Every training point runs the lockstep harness of grpo_vs_trl.py (one framework's step at a time, the order
flipping every step; --warmup steps excluded, --steps timed) on the qwen3vocab workload's model (a Qwen3 shape with
hidden 256, 4 layers, 8 heads / 4 KV heads, tied embeddings) with GSM8K prompts through the Qwen3 tokenizer, and
changes only its factor: the base point is 1 prompt x 8 samples, 128 response tokens, TP=DP=1, the in-process
engine. A random model never samples EOS at a large vocabulary, so responses have exactly max_new_tokens tokens
(at vocabulary 16 EOS is 1 token in 16: the CSV gives the tokens each point generated). Peak memory is the whole
process tree's (PSS: shared pages split between processes; RSS of the largest kind of process beside it).
Each row says how time and memory grew from the previous point: the exponent k of value^k between the two points
(1: linear, 0: flat, > 1.2: faster than linear), and the JSON holds a note per factor on why.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import add_output_args, output_path
from benchmarks.gpu.common import write_csv  # rows of different keys: the header is their union
from benchmarks.peers.grpo_vs_trl import prepare, run_round
from benchmarks.peers.grpo_vs_trl_report import summarize
from benchmarks.peers.grpo_workloads import SEED, TINY_MODEL, WORKLOADS, Workload
from benchmarks.tools.proctree import machine

BASE = WORKLOADS["qwen3vocab"].with_changes(name="scaling", prompts_per_step=1, trl_micro_batch=8)
KERNEL_H, KERNEL_V = 256, 151936


def vocab_workload(v: int) -> Workload:
    """The base model with vocabulary v, on the synthetic `sum` prompts (16-token tokenizer: any v >= 16 encodes
    them; ids the tokenizer does not know decode to nothing, so the reward is simply lower)."""
    return BASE.with_changes(name=f"vocab{v}", data="sum", max_prompt_length=32,
                             reward="builtin",
                             model={"tokenizer": TINY_MODEL["tokenizer"], "vocab_size": v})


def ranks_workload(label: str) -> Workload:
    kind, n = label[:2], int(label[2:])
    over = (f"actor.tp={n}",) if kind == "tp" else (f"trainer.n_gpus_per_node={n}",)
    # DP n splits the prompts: give every replica the base point's prompt
    prompts = BASE.prompts_per_step * (n if kind == "dp" else 1)
    return BASE.with_changes(name=label, prompts_per_step=prompts, mgrpo_overrides=over)


def engines_workload(n: int) -> Workload:
    # each engine a slot of its own beside the trainer's one (colocated engines share the trainer's slots: 2 need 2
    # trainer ranks), so the trainer stays one rank at every point
    return BASE.with_changes(name=f"engines{n}", rollout="sglang_cpu",
                             mgrpo_overrides=(f"rollout.num_engines={n}", "rollout.mode=disaggregated",
                                              f"trainer.n_gpus_per_node={n + 1}"))


FACTORS = {
    "length": dict(
        unit="response tokens per sample (max_new_tokens)", log_x=True,
        full=[64, 128, 256, 512, 1024], quick=[64, 256, 1024], trl_max=512,
        workload=lambda v: BASE.with_changes(name=f"len{v}", max_new_tokens=v)),
    "vocab": dict(
        unit="vocabulary size (tokens)", log_x=True,
        full=[16, 1024, 16384, 65536, 151936], quick=[16, 16384, 151936], trl_max=151936,
        workload=vocab_workload),
    "prompts": dict(
        unit="prompts per step (x 8 samples, 128 tokens each)", log_x=True,
        full=[1, 2, 4, 8], quick=[1, 4], trl_max=8,
        workload=lambda v: BASE.with_changes(name=f"prompts{v}", prompts_per_step=v)),
    "ranks": dict(
        unit="Megatron ranks over gloo (TP splits each layer, DP replicates)", log_x=False,
        full=["tp1", "tp2", "tp4", "dp2", "dp4"], quick=["tp1", "tp2", "dp2"], trl_max=None,
        workload=ranks_workload),
    "engines": dict(
        unit="rollout engines (SGLang-protocol CPU servers, router at 2)", log_x=False,
        full=[1, 2], quick=[1, 2], trl_max=None, workload=engines_workload),
    "kernel": dict(
        unit="tokens T through the output layer",
        log_x=True, full=[256, 512, 1024, 2048, 4096], quick=[256, 1024, 2048], trl_max=None, workload=None),
}

# Why each factor grows the way it does (the measured exponents are in the rows; these are the reasons).
NOTES = {
    "length": (
        "Time grows with response length on both sides: each new token is one decode step whose price is mostly "
        "the LM head (H x V = 39M multiply-adds per row, against ~1M for the 4-layer body), and the log-prob "
        "forwards and the update are linear in tokens too. mgrpo's measured exponent is 0.7-1.0 up to 512 tokens; "
        "from 512 to 1024 it is 1.4 (generation 2.9x, reference 2.5x, update 2.0x): every decode step attends over "
        "the whole prefix and transformers' KV cache grows by concatenation, both linear per step and so quadratic "
        "per sequence, and the test suite ran beside that point. TRL's exponent is lower (0.6-0.8) because its fixed "
        "part, scoring every prompt position (~150 per row) in the reference forward and the update, does not grow. "
        "mgrpo's memory is nearly flat (exponents 0.04-0.18, 2.4 -> 3.4 GiB from 64 to 1024 tokens): the kernel "
        "holds one chunk of logits whatever the length, training micro-batches are capped at "
        "actor.max_tokens_per_gpu tokens, and the engine holds one decode step of logits (trimmed every 16 steps); "
        "what grows is the body's activations and the KV cache. TRL's grows with length (0.2-0.44, 2.9 -> 6.1 GiB "
        "from 64 to 512): its micro-batch is a number of rows, so every layer's activations and the LM head's tiles "
        "for rows x (prompt + response) positions are held for the backward. TRL is not run at 1024 (its 512 point "
        "alone took 130 s a step)."),
    "vocab": (
        "At a small vocabulary the body and the fixed per-step costs (Ray round trips, process hand-offs, the "
        "optimizer) dominate, and both sides take about a second. From a few thousand tokens on the LM head and the "
        "embedding take over: every token's log-prob needs all V logits, in generation, in the reference forward "
        "and in the update, so the V-dependent part of a step is linear in V; the measured exponent between "
        "16,384 and 151,936 (0.74-0.78) is below 1 because the fixed part still counts at this small body. TRL "
        "spends more there: its chunked LM head scores every padded position (prompt too), mgrpo's kernel the "
        "response positions only. Memory's V-dependent part is the tied V x H fp32 embedding in every copy: "
        "mgrpo's rank holds 5 (actor, gradient buffer, two Adam moments, reference; the hybrid engine shares the "
        "actor's), TRL's process 5. At V=16 mgrpo's tree is ~430 MiB above TRL's one process (its driver and Ray's "
        "processes, each a runtime); at V=151,936, after the rank's heap changes, it is below it (2,137 vs 2,283 MiB): "
        "the rank returns what each call frees, and the kernel holds one chunk of 220 tokens x V while TRL's "
        "LM-head tiles cover its 1,064 positions. Measured before those changes, mgrpo's was 3,546 MiB. The totals "
        "grow sublinearly because the runtimes do not grow. The logits are never whole on either side."),
    "prompts": (
        "More prompts per step (x 8 samples) grow time linearly on both sides: generation is batched but on CPU a "
        "batch of rows costs about rows x the work of one, and every log-prob forward and the update are linear in "
        "tokens. mgrpo's memory grows with the update's micro-batch until it reaches actor.max_tokens_per_gpu "
        "(8,192 tokens: 32 rows of ~233 positions are 7,456, still one micro-batch, so 1 -> 4 prompts holds 4x the "
        "activations; beyond the budget it would stay flat); the kernel's chunk and the engine's one decode step "
        "of logits do not grow. TRL's micro-batch is fixed here (8 rows, gradient accumulation), so its training "
        "memory stops growing from 2 prompts on; what grows is generation's batch and KV cache."),
    "ranks": (
        "On this 2-core machine more ranks cannot make a step faster. TP 1 -> 2 -> 4 keeps the step flat (measured "
        "exponents -0.2 and 0.0): each rank does 1/n of every matmul, but the ranks share two cores and add gloo "
        "all-reduces per layer and per kernel chunk (and the weight export all-gathers each tensor). Its memory grows "
        "sublinearly (0.35, 0.34): the weights, vocabulary included, are split over the ranks, but each rank is a "
        "process with its own torch/megatron/Ray runtime (~0.5 GB), so four ranks hold four runtimes for one model. "
        "DP n replicates the model and gives each replica the base point's prompt, n times the work: time grows "
        "sublinearly (0.47, 0.68) while replicas still find a free core, memory nearly linearly (0.76, 0.86: each "
        "replica holds full weights, gradients, Adam states and the reference). On GPUs the same splits are what "
        "make a model fit; here they show the fixed cost per process."),
    "engines": (
        "Two engines behind SGLang's router each get half the requests (one per POST), so generation splits "
        "but the two server processes share 2 cores with the trainer: the step does not get faster here. Each "
        "engine is a process holding the full model plus its runtime, so memory grows linearly with engines; "
        "the router adds one small process. A weight sync pushes the full model to every engine."),
    "kernel": (
        "Full logits (naive) keep [T x V] fp32 logits, their softmax and gradient: working memory linear in T "
        "(about 5 bytes x 4 copies per logit). The chunked kernel holds one chunk of 512 tokens x V logits and "
        "the V x H weight gradient whatever T: flat in T. Both do the same three GEMMs, so time is linear in T "
        "for both; the chunked one is faster because it never writes and re-reads the [T x V] tensors."),
}


PHASE_COLUMNS = {"generate": "generate", "reward": "reward", "old-policy log-probs": "old_logprob",
                 "reference log-probs": "ref_logprob", "update (fwd+bwd+optimizer)": "update",
                 "weight sync": "weight_sync", "other": "other"}


# ======================================================================================================
# a training point: the lockstep harness with one or both sides
# ======================================================================================================
def run_point(factor: str, value, w: Workload, sides: list[str], a, workdir: str) -> list[dict]:
    total = a.warmup + a.steps + 1
    base = prepare(w, workdir, total, a.threads)
    t0, load0 = time.time(), os.getloadavg()[0]
    res = run_round(f"{factor}_{value}", sides, base, workdir, a.timeout)
    rows = []
    for kind in sides:
        s = summarize(kind, [res[kind]], a.warmup, 1)
        kinds = res[kind]["memory"]["by_process_kind"]
        big = max(kinds.items(), key=lambda kv: kv[1]["peak_rss_mib"])
        ph = s["aligned_phase_medians_s"]
        rows.append({
            "factor": factor, "value": value, "system": "TRL GRPOTrainer" if kind == "trl" else "mgrpo",
            "median_step_s": round(s["median_step_s"], 3), "cpu_s_per_step": round(s["cpu_s_per_step"], 3),
            "response_tokens_per_step": round(s["response_tokens_per_step"], 1),
            "response_tokens_per_s": round(s["response_tokens_per_s"], 1),
            "peak_pss_tree_mib": round(s["peak_pss_tree_mib"]), "peak_rss_tree_mib": round(s["peak_rss_tree_mib"]),
            "largest_kind": big[0], "largest_kind_processes": big[1]["processes"],
            "largest_kind_peak_rss_mib": round(big[1]["peak_rss_mib"]), "processes": s["max_processes"],
            **{f"{PHASE_COLUMNS[k]}_s": round(v, 3) for k, v in ph.items()},
            "mgrpo_ref_on_ranks_s": round(s["phase_medians_s"].get("timing_s/ref_on_ranks", 0.0), 3),
            "rows": w.rows, "max_new_tokens": w.max_new_tokens, "vocab": w.model["vocab_size"],
            "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
            "wall_s": round(time.time() - t0, 1),
        })
        print(f"  {factor}={value} {kind:5}: step {rows[-1]['median_step_s']:.2f}s, "
              f"tree PSS {rows[-1]['peak_pss_tree_mib']} MiB, {rows[-1]['response_tokens_per_step']:.0f} "
              f"response tokens/step (load {load0:.1f})", flush=True)
    return rows


def run_kernel_point(T: int, a) -> list[dict]:
    from benchmarks.peers.kernel_bench import measure, parse_args

    impls = "naive,chunked" if T <= a.naive_max_t else "chunked"
    bargs = parse_args(["--T", str(T), "--H", str(KERNEL_H), "--V", str(KERNEL_V), "--impls", impls,
                        "--repeats", "1" if a.quick else "2", "--warmup", "1", "--threads", str(a.threads),
                        "--liger-seq", "128"])
    load0 = os.getloadavg()[0]
    out, _ = measure(bargs)
    rows = []
    for r in out:
        if "error" in r:
            print(f"  kernel T={T} {r['impl']}: {r['error']}", flush=True)
            continue
        rows.append({"factor": "kernel", "value": T,
                     "system": "full logits (naive)" if r["impl"] == "naive" else "mgrpo chunked kernel",
                     "median_step_s": r["median_s"], "peak_extra_mib": r["peak_extra_mib"],
                     "full_logits_mib": round(T * KERNEL_V * 4 / 2**20, 1), "loadavg_start": round(load0, 2),
                     "loadavg_end": round(os.getloadavg()[0], 2)})
    return rows


# ======================================================================================================
# growth, outputs, plots
# ======================================================================================================
def numeric(factor: str, value) -> float:
    return float(value[2:]) if factor == "ranks" else float(value)


def add_growth(rows: list[dict], factor: str) -> None:
    """Per system: exponent k with metric ~ value^k between each point and the previous one."""
    mem_key = "peak_extra_mib" if factor == "kernel" else "peak_pss_tree_mib"
    for system in {r["system"] for r in rows}:
        pts = [r for r in rows if r["system"] == system]
        if factor == "ranks":  # TP and DP grow separately from the single rank
            for kind in ("tp", "dp"):
                chain = [r for r in pts if r["value"] == "tp1" or r["value"].startswith(kind)]
                _growth(chain, factor, mem_key)
        else:
            _growth(pts, factor, mem_key)


def _growth(pts: list[dict], factor: str, mem_key: str) -> None:
    for prev, cur in zip(pts, pts[1:]):
        dx = math.log(numeric(factor, cur["value"]) / numeric(factor, prev["value"]))
        for key, name in (("median_step_s", "time"), (mem_key, "memory")):
            if prev.get(key) and cur.get(key) and dx:
                k = math.log(cur[key] / prev[key]) / dx
                cur[f"{name}_exponent"] = round(k, 2)
                cur[f"{name}_grows"] = ("faster than linear" if k > 1.2 else "linear" if k >= 0.8 else
                                        "sublinear" if k >= 0.2 else "flat" if k > -0.2 else "shrinks")


def read_csv(factor: str, path: str) -> list[dict]:
    """A factor's CSV back as rows with numbers (what `plot` takes)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in ("system", "largest_kind", "time_grows", "memory_grows") or (k == "value" and factor == "ranks"):
                continue
            try:
                r[k] = float(v) if v != "" else None
            except ValueError:
                pass
        if factor != "ranks" and r["value"] is not None:
            r["value"] = int(r["value"])
    return rows


def plot(factor: str, rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = FACTORS[factor]
    kernel = factor == "kernel"
    panels = [("median_step_s", "time per call (s)" if kernel else "median step time (s)"),
              ("peak_extra_mib" if kernel else "peak_pss_tree_mib",
               "peak working memory (MiB)" if kernel else "peak memory, process tree PSS (MiB)")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("mgrpo"), s))
    for ax, (key, label) in zip(axes, panels):
        for system in systems:
            pts = [r for r in rows if r["system"] == system and r.get(key) is not None]
            xs = list(range(len(pts))) if factor == "ranks" else [numeric(factor, r["value"]) for r in pts]
            ax.plot(xs, [r[key] for r in pts], marker="o", label=system)
            if factor == "ranks":
                ax.set_xticks(xs, [r["value"].upper() for r in pts])
        if kernel and key == "peak_extra_mib":
            ts = sorted({r["value"] for r in rows})
            ax.plot(ts, [t * KERNEL_V * 4 / 2**20 for t in ts], linestyle=":", color="grey",
                    label="one [T x V] fp32 tensor")
        if spec["log_x"]:
            ax.set_xscale("log", base=2)
        if kernel or factor in ("length", "vocab"):
            ax.set_yscale("log")
        ax.set_xlabel(spec["unit"])
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    title = {"kernel": f"Log-prob kernel vs full logits (H={KERNEL_H}, V={KERNEL_V:,}, fp32, forward + backward)",
             "length": "GRPO step vs response length", "vocab": "GRPO step vs vocabulary size",
             "prompts": "GRPO step vs prompts per step", "ranks": "GRPO step vs Megatron ranks (gloo, 2 cores)",
             "engines": "GRPO step vs rollout engines (2 cores)"}[factor]
    loads = [r["loadavg_start"] for r in rows if r.get("loadavg_start") is not None]
    load = f", load {min(loads):.0f}-{max(loads):.0f}" if loads else ""
    fig.suptitle(f"{title}\n(CPU, 2 shared cores{load}: times are noisy, memory is not)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer points per factor, TRL only up to 256 tokens")
    ap.add_argument("--factors", default=",".join(FACTORS), help=f"comma list of {', '.join(FACTORS)}")
    ap.add_argument("--values", default=None, help="comma list of values (with one factor): instead of its own")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per point (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="excluded steps per point (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--no-trl", action="store_true", help="mgrpo only")
    ap.add_argument("--naive-max-t", type=int, default=2048,
                    help="largest T for the full-logits kernel (its memory: ~4 x T x V x 4 bytes)")
    add_output_args(ap, "", flag="--out-dir")  # a folder: scaling_<factor>.csv/.png, scaling.json
    ap.add_argument("--workdir", default=None, help="scratch folder, kept (default: a temp dir, removed)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for start-up or one step")
    ap.add_argument("--replot", action="store_true", help="redraw the PNGs from the CSVs under --out-dir; run nothing")
    a = ap.parse_args(argv)
    a.out_dir = output_path(a, "", flag="out_dir", folder=True)
    if a.replot:
        for factor in a.factors.split(","):
            path = os.path.join(a.out_dir, f"scaling_{factor}.csv")
            if os.path.exists(path):
                plot(factor, read_csv(factor, path), path[:-4] + ".png")
                print(f"redrew {path[:-4]}.png")
        summary_path = os.path.join(a.out_dir, "scaling.json")
        if os.path.exists(summary_path):  # the reasons are text kept here: the JSON gets the current ones
            with open(summary_path) as f:
                summary = json.load(f)
            for factor, fd in summary["factors"].items():
                fd["note"] = NOTES[factor]
            with open(summary_path, "w") as f:
                json.dump(summary, f, indent=1, default=str)
        return
    factors = a.factors.split(",")
    unknown = set(factors) - set(FACTORS)
    if unknown:
        ap.error(f"unknown factors {sorted(unknown)}; known: {list(FACTORS)}")
    keep = a.workdir is not None
    workdir = a.workdir or tempfile.mkdtemp(prefix="scaling-")
    os.makedirs(a.out_dir, exist_ok=True)
    summary = {"command": " ".join(["python", "-m", "benchmarks.peers.scaling"] + sys.argv[1:]),
               "machine": machine(), "base_point": {**BASE.to_dict(), "model_label": BASE.model_label()},
               "seed": SEED, "factors": {}}
    t_all = time.time()
    for factor in factors:
        spec, t0 = FACTORS[factor], time.time()
        values = spec["quick" if a.quick else "full"]
        if a.values:
            values = [type(values[0])(v) for v in a.values.split(",")]
        print(f"{factor}: {values}", flush=True)
        rows: list[dict] = []
        for v in values:
            if factor == "kernel":
                rows += run_kernel_point(v, a)
                continue
            trl_max = 256 if (a.quick and factor == "length") else spec["trl_max"]
            with_trl = not a.no_trl and trl_max is not None and numeric(factor, v) <= trl_max
            rows += run_point(factor, v, spec["workload"](v), ["trl", "mgrpo"] if with_trl else ["mgrpo"], a,
                              workdir)
        add_growth(rows, factor)
        csv_path, png_path = (os.path.join(a.out_dir, f"scaling_{factor}.{ext}") for ext in ("csv", "png"))
        write_csv(Path(csv_path), rows)
        try:
            plot(factor, rows, png_path)
        except ImportError as err:  # the measurements are kept; `--replot` draws them once matplotlib is there
            print(f"{factor}: no plot ({err}); the CSV and JSON are written", flush=True)
        summary["factors"][factor] = {"unit": spec["unit"], "values": values, "note": NOTES[factor],
                                      "wall_s": round(time.time() - t0), "rows": rows}
        print(f"{factor}: wrote {csv_path} and {png_path} ({time.time() - t0:.0f}s)", flush=True)
    summary["wall_s"] = round(time.time() - t_all)
    summary["machine"]["loadavg_at_end"] = os.getloadavg()
    # Factors run separately gather in one JSON (each keeps the command and machine it ran with).
    path = os.path.join(a.out_dir, "scaling.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("factors", {})
    for f_ in summary["factors"].values():
        f_.update(command=summary["command"], machine=summary["machine"], quick=a.quick)
    summary["factors"] = {**old, **summary["factors"]}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"wrote {path}; this run took {summary['wall_s'] / 60:.0f} min")
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
