"""The docs' measured numbers, rendered from the committed results files (benchmarks/results/), so the
pages say what the files say and nothing else.

    python -m benchmarks.tools.readme_table          # show what would change
    python -m benchmarks.tools.readme_table --write  # rewrite the pages' rendered blocks
    python -m benchmarks.tools.readme_table --check  # exit 1 when a page and the files disagree

Each block sits between `<!-- readme_table:NAME -->` and `<!-- /readme_table:NAME -->` in the page PAGES names:
  learning-main (README.md) the main job's learning over seeds (learning_history.jsonl)
  learning   (docs/results.md) every recipe's learning over seeds (learning_history.jsonl, from
             benchmarks/tools/learning_history.py): the only place learning figures come from
  main-job   (docs/results.md) the main job's time and memory (main_job_cpu.json)
  plan       (docs/scale-and-planning.md) the planner's table for the 8B recipe (plan_qwen3_8x80gb.json, from
             benchmarks/measure/plan_table.py)
  results    (docs/results.md) the Results table; a row whose results file is missing is left out (its command
             makes the file)
  test-tiers (docs/development.md) the test tiers' commands, counts and wall times (test_suite_cpu.json, from
             benchmarks/tools/test_suite.py)
  perf       (docs/results.md) the standing comparisons' last line (perf_history.jsonl, from
             benchmarks/tools/perf_history.py)
Links into benchmarks/ are written relative to the page. tests/benchmarks/test_readme_results.py fails when a page is not what
this renders.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import glob
import json
import os
import re
import sys
from typing import Callable, Optional

from benchmarks import REPO, RESULTS



def _json(name: str) -> Optional[dict]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _csv(name: str) -> Optional[list[dict]]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _command(recorded: str) -> str:
    """A results file's command as it runs today, in backquotes. Files written before benchmarks/ became a
    package record `python benchmarks/<name>.py ...`; the script is now `benchmarks/<folder>/<name>.py`, run
    as `python -m benchmarks.<folder>.<name> ...` (the files themselves stay as they were measured)."""
    def today(m: re.Match) -> str:
        found = glob.glob(os.path.join(REPO, "benchmarks", "*", m.group(1) + ".py"))
        if len(found) != 1:
            return m.group(0)
        return f"python -m benchmarks.{os.path.basename(os.path.dirname(found[0]))}.{m.group(1)}"

    return "`" + re.sub(r"\bpython benchmarks/(\w+)\.py\b", today, recorded) + "`"


def _load(machine: dict) -> str:
    """The 1-minute load average a run started at, as the results file recorded it."""
    for key in ("loadavg_at_start", "load_avg_1m_at_start"):
        if key in machine:
            value = machine[key]
            return f"{value[0] if isinstance(value, list) else value:.0f}"
    return "?"


# --- main job ------------------------------------------------------------------------------------------
def main_job_block() -> str:
    m = _json("main_job_cpu.json")
    return (f"The default job's costs: {m['wall_s']:.0f} s of wall time, first step after "
            f"{m['time_to_first_step_s']:.0f} s, median step {m['median_step_s']:.2f} s, peak process-tree memory "
            f"{m['peak_pss_tree_mib']:,.0f} MiB PSS at load ~{_load(m['machine'])} (`python -m benchmarks.jobs.main_job`; "
            f"its rewards are the learning history's).")


def _history() -> list[dict]:
    from benchmarks.tools import learning_history

    return learning_history.read_history(os.path.join(RESULTS, "learning_history.jsonl"))


def learning_main_block() -> str:
    """The main job's learning, from the newest committed learning-history line that ran it."""
    from benchmarks.tools import learning_history

    got = learning_history.latest(_history()).get("main")
    if got is None:
        return "(no learning-history line for the main job yet: `python -m benchmarks.tools.learning_history`)"
    seeds = sorted(got["seeds"], key=int)
    firsts = sorted(r["first10"] for r in got["seeds"].values())
    return (f"Mean reward over the last 10 of {got['seeds'][seeds[0]]['steps']} steps, trainer.seed "
            f"{seeds[0]}-{seeds[-1]}: **{got['min']:.3f} to {got['max']:.3f}, median {got['median']:.3f}** "
            f"(the first 10 steps: {firsts[0]:.3f} to {firsts[-1]:.3f}); commit {got['commit']}, "
            f"{got['date_utc'][:10]}, `python -m benchmarks.tools.learning_history --recipes main`. Its time and "
            f"memory on a quiet machine: [results](docs/results.md).")


def learning_block() -> str:
    """Every recipe's newest committed line: min / median / max over seeds against its floor."""
    from benchmarks.tools import learning_history

    history = _history()
    if not history:
        return "(no learning history yet: `python -m benchmarks.tools.learning_history --update-results`)"
    cpus = sorted({line["machine"]["cpu_model"] for line in history if not line.get("overrides")})
    return (learning_history.table(history) + "\n\nMean reward over the first and last 10 steps, per seed "
            f"(`trainer.seed`), on the 2-core development machine ({', '.join(cpus)}). Command: "
            "`python -m benchmarks.tools.learning_history [--recipes ...] [--seeds ...]`; the history is "
            "`benchmarks/results/learning_history.jsonl`.")


# --- the planner's table ---------------------------------------------------------------------------------
def plan_block() -> str:
    p = _json("plan_qwen3_8x80gb.json")
    r = p.get("recipe")
    shipped = ""
    if r:
        colocated = f"colocated SGLang at {r['rollout.gpu_memory_utilization']}" if r["rollout.mode"] == "colocated" \
            else f"{r['rollout.mode']} SGLang"
        shipped = (f"; the recipe as shipped uses actor.tp={r['actor.tp']}"
                   + (f", actor.pp={r['actor.pp']}" if r["actor.pp"] != 1 else "")
                   + f", a {r['actor.max_tokens_per_gpu']:,}-token budget, {colocated}, "
                   + ("no recompute" if not r["actor.recompute"] else f"recompute {r['actor.recompute']}") + " and "
                   + ("the" if r["actor.use_distributed_optimizer"] else "no") + " distributed optimizer")
    lines = [f"({_command(p['command'])}{shipped}):", "",
             "| model | nodes x 8 GPUs | peak per GPU (recipe) | verdict | largest term | change that fits (peak) |",
             "|---|---|---|---|---|---|"]
    for row in p["rows"]:
        fix = f"`{row['suggestion']}` ({row['suggested_peak_gib']} GiB)" if row["suggestion"] else \
            ("none needed" if row["fits"] else "none within 4 knob changes: more GPUs needed")
        lines.append(f"| {row['model']} | {row['nodes']} | {row['peak_gib']} GiB ({row['peak_phase']}) | "
                     f"{'FITS' if row['fits'] else 'DOES NOT FIT'} | {row['largest_term']} "
                     f"{row['largest_term_gib']} GiB | {fix} |")
    return "\n".join(lines)


# --- the Results table -----------------------------------------------------------------------------------
Row = Callable[[], Optional[tuple[str, str, str]]]
"""-> (what, command, result), or None when its results file is missing."""


def _rollout_row(name: str, what: str, command: str, extra: Callable[[dict], str] = lambda r: "") -> Row:
    def row():
        d = _json(name)
        if d is None:
            return None
        r = d["rows"][0]
        return (what, f"`{command}`",
                f"{r['steps']} steps; median step "
                f"{r['median_step_s']:.3f} s{extra(r)}, {r['wall_s']:.0f} s wall at load ~{_load(d['machine'])}")
    return row


def row_main_job():
    m = _json("main_job_cpu.json")
    if m is None:
        return None
    return ("main job learns (production rollout path, the default)", "`python -m benchmarks.jobs.main_job`",
            f"{m['steps']} steps; step-1 `rollout/logprob_abs_diff` {m['logprob_abs_diff_step1']:.1e}, `actor/ppo_kl` "
            f"{m['ppo_kl_step1']}; median step {m['median_step_s']:.2f} s, {m['wall_s']:.0f} s wall, peak "
            f"process-tree memory {m['peak_pss_tree_mib']:,.0f} MiB PSS ({m['max_processes']} processes) at load "
            f"~{_load(m['machine'])}")


def row_async():
    d = _json("async_vs_sync_cpu.json")
    if d is None:
        return None
    sync, one = (next(r for r in d["rows"] if r["variant"] == v) for v in ("sync-disaggregated", "async-one-step-off"))
    pinned = ", trainer and engine pinned to a core each" if one["pinned"] else ""
    return ("asynchronous rollout", "`python -m benchmarks.jobs.rollout_paths --only sync --pin`",
            f"one-step-off vs synchronous, disaggregated SGLang-protocol engine{pinned}: "
            f"**{one['response_tokens_per_s']:,.0f} vs {sync['response_tokens_per_s']:,.0f} response tokens/s "
            f"({d['async_over_sync_response_tokens_per_s']:.2f}x)**, median step {one['median_step_s']:.2f} vs "
            f"{sync['median_step_s']:.2f} s; at load ~{_load(d['machine'])}")


def row_chaos():
    d = _json("chaos_cpu.json")
    if d is None:
        return None
    parts = []
    for name, label in (("default", "default job"), ("async_tp2", "one-step-off, TP=2"),
                        ("multi_turn", "multi-turn tool task")):
        j = d["jobs"].get(name)
        if j is None:
            continue
        v = j["vs_uninterrupted"]
        once = "every step once in metrics, TensorBoard and trajectories" if all(j["records"].values()) else \
            f"records NOT complete ({j['records']})"
        exact = "bit-exact" if v["hf_bit_exact"] else f"max abs diff {v['hf_max_abs_diff']:.1e}"
        own = (j.get("fault_free_steps_vs_reference") or {}).get("first_step_differs")
        if own is not None:
            exact += f" (two runs without faults already differ from step {own}: the job's own nondeterminism)"
        parts.append(f"{label}: {j['steps']} steps, {len(j['faults'])} faults of {len(j['fault_kinds'])} kinds in "
                     f"{len(j['attempts'])} attempts, {once}, final HF export vs the run without faults {exact}; "
                     f"{j['chaos_wall_s']:.0f} s wall at load ~{j['loadavg_at_start'][0]:.0f}")
    return ("chaos soak", "`python -m benchmarks.jobs.chaos`", "; ".join(parts))


def row_weight_sync():
    d = _json("weight_sync_cpu.json")
    if d is None:
        return None
    rows = {r["transport"]: r for r in d["rows"] if r["preset"] == "qwen3-0.6b"}
    t, g, c = rows["tensor"], rows["distributed"], rows["memcpy"]
    return (f"weight sync into the server (Qwen3-0.6B shape, fp32, {t['bytes'] / 1e9:.2f} GB)",
            _command(d["command"]),
            f"shared-memory tensors {t['seconds_median']:.1f} s ({t['gb_s']:.2f} GB/s), gloo broadcast "
            f"{g['seconds_median']:.1f} s ({g['gb_s']:.2f} GB/s), plain memory copy {c['seconds_median']:.1f} s "
            f"({c['gb_s']:.2f} GB/s); at load {d['machine']['load_avg_1m_at_start']:.0f}-"
            f"{d['machine']['load_avg_1m_at_end']:.0f}")


def row_ops():
    d = _json("ops_cpu.json")
    if d is None:
        return None
    return ("resume, nodes, SLURM", "`python -m pytest tests/e2e/test_resume_kill.py "
            "tests/cluster/test_ray_two_nodes.py tests/cluster/test_slurm_real.py tests/e2e/test_async_rollout.py`",
            "after SIGKILL of everything, later steps equal the uninterrupted run within 1e-6, each step once in "
            "metrics, trajectories and TensorBoard; over two `ray start` nodes the engine on the other node samples "
            "from exactly the trainer's weights after every sync and a dead worker node is named; a "
            "real one-node SLURM runs, "
            "requeues (scontrol, USR1, TERM) and resumes the sbatch job (`benchmarks/results/ops_cpu.json`; the SLURM "
            "tests need `slurm/testing/local_cluster.sh up`, which `.ci/run` does)")


def row_doctor():
    d = _json("doctor_main_job_cpu.json")
    if d is None:
        return None
    run, layers = d["run"], d["layers_worst_sequence"]
    t = run["tokens"]
    steps = [s["mean"] for s in run["per_step"]]
    fp32, bf16 = layers["float32"]["sites"], layers.get("bfloat16", {}).get("sites")
    exact = [k for k, v in fp32.items() if v == 0.0]
    text = (f"`mgrpo-doctor run`: {t['count']:,} response tokens over {run['steps']} steps, mean |diff| "
            f"{t['mean']:.1e} (p99 {t['p99']:.1e}, max {t['max']:.1e}), per step {min(steps):.1e}..{max(steps):.1e}; "
            f"`layers` on the worst sequence: {len(exact)} of {len(fp32)} sites bitwise equal in fp32, "
            f"{max(fp32.values()):.0e} at most")
    if bf16:
        text += f"; the engine in bf16 within {max(bf16.values()):.0e} on this 2-layer model"
    return ("engine vs trainer, token by token (the default job)", "`python -m benchmarks.jobs.doctor_main_job`",
            text + " (`benchmarks/results/doctor_main_job_cpu.{json,txt}`; numbers, not timings)")


def row_step0():
    m = _json("main_job_cpu.json")
    if m is None:
        return None
    return ("step-0 invariants", "same run, and `tests/e2e/test_e2e.py`",
            f"`rollout/logprob_abs_diff` {m['logprob_abs_diff_step1']:.1e} (engine vs Megatron, same tokens and "
            f"weights); `actor/ppo_kl` {m['ppo_kl_step1']}")


def row_kernel():
    rows = _csv("kernel_cpu.csv")
    d = _json("kernel_cpu.json")
    if rows is None or d is None:
        return None
    by = {r["impl"]: r for r in rows}
    a = d["args"]
    naive, chunked, liger = by["naive"], by["chunked"], by.get("liger")
    text = (f"reference {float(naive['median_s']):.1f} s / {float(naive['peak_extra_mib']):,.0f} MiB extra; "
            f"**chunked {float(chunked['median_s']):.1f} s ({float(chunked['time_vs_naive']):.2f}x) / "
            f"{float(chunked['peak_extra_mib']):,.0f} MiB ({100 * float(chunked['mem_vs_naive']):.1f}%)**")
    if liger:
        text += (f"; Liger {d['machine'].get('liger-kernel', '')} {float(liger['median_s']):.1f} s "
                 f"({float(liger['time_vs_naive']):.2f}x) / {float(liger['peak_extra_mib']):,.0f} MiB "
                 f"({100 * float(liger['mem_vs_naive']):.1f}%)")
    return (f"fused kernel vs full logits and Liger (T={a['T']}, H={a['H']}, V={a['V']:,}, {a['dtype']}, fwd+bwd)",
            f"`python -m benchmarks.peers.kernel_bench --T {a['T']} --H {a['H']} --V {a['V']} --dtype {a['dtype']} "
            f"--repeats {a['repeats']}`", text + f"; at load ~{d['loadavg_at_end'][0]:.0f}")


def row_kernel_support():
    rows, d = _csv("kernel_support_cpu.csv"), _json("kernel_support_cpu.json")
    if rows is None or d is None:
        return None
    a = d["args"]
    parts = [f"{'full vocabulary' if r['support'] == 'none' else r['support']} {float(r['median_s']):.1f} s / "
             f"{float(r['peak_extra_mib']):,.0f} MiB" for r in rows]
    return (f"fused loss over sampling supports (T={a['T']}, H={a['H']}, V={a['V']:,}, {a['dtype']}, fwd+bwd, chunked)",
            f"`python -m benchmarks.peers.kernel_bench --T {a['T']} --H {a['H']} --V {a['V']} --impls {a['impls']} "
            f"--support {a['support']}`", "; ".join(parts) + f" (random ids: the worst case for a chunk's union); at load "
            f"~{d['loadavg_at_start'][0]:.0f}")


def row_logprob_support():
    d = _json("logprob_support_cpu.json")
    if d is None:
        return None
    r, b = d["runs"], d["bias"]
    layouts = [("sampled-k5p09", "TP 1"), ("sampled-k5p09-tp2", "TP 2"), ("sampled-k5p09-cp2", "CP 2")]
    diffs = ", ".join(f"{r[k]['logprob_abs_diff_step1']:.1e} ({name})" for k, name in layouts)
    worst = max(r[k]["logprob_abs_diff_max_all_steps"] for k, _ in layouts)

    def last10(setting):
        return ", ".join(f"{r[f'full-{setting}{s}']['reward_last10']:.2f}/{r[f'sampled-{setting}{s}']['reward_last10']:.2f}"
                         for s in ("", "-seed2", "-seed3"))

    p09, k5 = b["top_k=20 top_p=0.9, initial policy"], b["top_k=5 top_p=0.9, initial policy"]
    return ("log-probs over the sampling support (top-k / top-p)", "`python -m benchmarks.jobs.logprob_support`",
            f"`algorithm.logprob_support=sampled` at top_k=5, top_p=0.9: step-1 `rollout/logprob_abs_diff` {diffs}, "
            f"at most {worst:.1e} per token over 150 steps; `actor/ppo_kl` {r['sampled-k5p09']['ppo_kl_step1']}. "
            f"What `full` gets wrong: pi_full/pi_sampled {p09['ratio_mean']:.2f} on every token at top_p=0.9 "
            f"({p09['mean_abs_logprob_diff']:.3f} nat), {k5['ratio_mean']:.2f} at top_k=5 on the initial policy. "
            f"Last-10 reward full/sampled, seeds 1-3: top_p=0.9 {last10('k20p09')}; top_k=5 {last10('k5p09')} "
            f"(neither learns there); load ~{d['loadavg_before'][0]:.0f} at the start, ~{d['loadavg_after'][0]:.0f} at the end. "
            f"top_k=5 with rollout.n=16, temperature 1.5, last-10 (first-10 <= 0.07 in each): in-process "
            f"{r['sampled-k5p09-n16-t15']['reward_last10']:.2f}; on the SGLang-protocol server seeds 1-3 "
            + ", ".join(f"{r[f'sampled-k5p09-n16-t15-sglang{s}']['reward_last10']:.2f}" for s in ("", "-seed2", "-seed3"))
            + f", TP 2 {r['sampled-k5p09-n16-t15-sglang-tp2']['reward_last10']:.2f}, "
            f"CP 2 {r['sampled-k5p09-n16-t15-sglang-cp2']['reward_last10']:.2f} (load 10-40). " + _k5_default_engine(r))


def _k5_default_engine(r: dict) -> str:
    """The issue's command as is on the default engine, and with rollout.n=16 actor.lr=3e-4."""
    def runs(name, suffixes):
        return ", ".join(f"{r[name + s]['reward_first10']:.2f} -> {r[name + s]['reward_last10']:.2f}" for s in suffixes)

    seeds = ("", "-seed2", "-seed3")
    stuck = [len(r["sampled-k5p09-sglang" + s]["reachable"]["unreachable"]) for s in seeds]
    return (f"The default job with top_k=5, top_p=0.9, sampled (default engine), first-10 -> last-10, seeds 1-3: "
            f"{runs('sampled-k5p09-sglang', seeds)}; its final policies cannot draw the answer of "
            f"{', '.join(map(str, stuck))} of 25 prompts under the cut. With rollout.n=16 actor.lr=3e-4: seeds 1-3 "
            f"{runs('sampled-k5p09-n16-lr3e4-sglang', seeds)}, TP 2 {runs('sampled-k5p09-n16-lr3e4-sglang', ('-tp2',))}, "
            f"CP 2 {runs('sampled-k5p09-n16-lr3e4-sglang', ('-cp2',))}; step-1 `rollout/logprob_abs_diff` "
            + ", ".join(f"{r['sampled-k5p09-n16-lr3e4-sglang' + s]['logprob_abs_diff_step1']:.1e}"
                        for s in ("", "-tp2", "-cp2"))
            + f" (TP 1, TP 2, CP 2), `actor/ppo_kl` {r['sampled-k5p09-n16-lr3e4-sglang']['ppo_kl_step1']} "
            f"(load {r['sampled-k5p09-sglang'].get('loadavg_1min', '?')})")


def _trl_results(name: str) -> Optional[tuple[dict, dict, dict, dict]]:
    """grpo_vs_trl.py's outputs <name>.{json,csv}: (the JSON, TRL's row, mgrpo's row, the ratios' row)."""
    d, rows = _json(f"{name}.json"), _csv(f"{name}.csv")
    if d is None or rows is None:
        return None
    by = {r["framework"]: r for r in rows}
    return d, by["trl"], by["mgrpo"], by["ratio_mgrpo_over_trl"]


def row_trl():
    got = _trl_results("grpo_vs_trl")
    if got is None:
        return None
    (d, t, m, ratio), f = got, float
    return ("mgrpo vs TRL GRPOTrainer, same tiny workload", _command(d["command"]),
            f"median step {f(m['median_step_s']):.3f} s vs {f(t['median_step_s']):.3f} s "
            f"(**{f(ratio['median_step_s']):.2f}x**), CPU per step {f(ratio['cpu_s_per_step']):.2f}x; response "
            f"tokens/s {f(m['response_tokens_per_s']):,.0f} vs {f(t['response_tokens_per_s']):,.0f}; peak tree PSS "
            f"{f(m['peak_pss_tree_mib']):,.0f} vs {f(t['peak_pss_tree_mib']):,.0f} MiB "
            f"(**{f(ratio['peak_pss_tree_mib']):.2f}x**; RSS {f(m['peak_rss_tree_mib']):,.0f} vs "
            f"{f(t['peak_rss_tree_mib']):,.0f}), {int(f(m['max_processes']))} processes vs "
            f"{int(f(t['max_processes']))}; mean reward over the last steps {f(m['final_reward']):.3f} vs "
            f"{f(t['final_reward']):.3f}; at load ~{_load(d['machine'])}. See `benchmarks/README.md`")


def row_trl_qwen3vocab(name: str) -> Row:
    """grpo_vs_trl.py --workload qwen3vocab's results <name>.{json,csv} (one row per batch size measured)."""
    def row():
        got = _trl_results(name)
        if got is None:
            return None
        (d, t, m, ratio), f = got, float
        w = d["workload"]
        extra = "".join(", mgrpo " + o for o in re.findall(r"--mgrpo (\S+)", d["command"]))  # its own settings
        return (f"mgrpo vs TRL GRPOTrainer at Qwen3's vocabulary (GSM8K, V=151,936, {w['prompts_per_step']} prompts x "
                f"{w['samples_per_prompt']}, <= {w['max_new_tokens']} tokens, TRL micro-batch {w['trl_micro_batch']} "
                f"rows{extra})",
                _command(d["command"]),
                f"median step {f(m['median_step_s']):.1f} s vs {f(t['median_step_s']):.1f} s "
                f"(**{f(ratio['median_step_s']):.2f}x**); response tokens/s {f(m['response_tokens_per_s']):,.1f} vs "
                f"{f(t['response_tokens_per_s']):,.1f}; peak tree PSS {f(m['peak_pss_tree_mib']):,.0f} vs "
                f"{f(t['peak_pss_tree_mib']):,.0f} MiB (**{f(ratio['peak_pss_tree_mib']):.2f}x**); {w['timed_steps']} "
                f"timed steps after {w['warmup_steps']} warm-up, at load ~{_load(d['machine'])}. Per-phase split in "
                f"`benchmarks/results/{name}.json`")
    return row


def _scaling_row(factor: str, what: str, image: bool = True, every_point: bool = False) -> Row:
    """A scaling factor (benchmarks/peers/scaling.py) with its first and last point per system (or every point: the
    ranks, whose points are not a line), and its plot."""
    def row():
        d, rows = _json("scaling.json"), _csv(f"scaling_{factor}.csv")
        if d is None or rows is None or factor not in d["factors"]:
            return None
        fd = d["factors"][factor]
        mem = "peak_extra_mib" if factor == "kernel" else "peak_pss_tree_mib"
        parts = []
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = [r for r in rows if r["system"] == system]
            if every_point:
                parts.append(f"{system}: " + ", ".join(f"{str(r['value']).upper()} {float(r['median_step_s']):.2f} s "
                                                       f"{float(r[mem]):,.0f} MiB" for r in pts))
                continue
            a, b = pts[0], pts[-1]
            parts.append(f"{system}: {a['value']} -> {b['value']}: {float(a['median_step_s']):.2f} -> "
                         f"{float(b['median_step_s']):.2f} s, {float(a[mem]):,.0f} -> {float(b[mem]):,.0f} MiB")
        loads = sorted({float(r["loadavg_start"]) for r in rows})
        return (what, _command(fd["command"]),
                (f"![scaling_{factor}](benchmarks/results/scaling_{factor}.png) " if image else "") + "; ".join(parts)
                + f" (`benchmarks/results/scaling_{factor}.csv`: growth exponents and why, in scaling.json); at load "
                f"~{loads[0]:.0f}-{loads[-1]:.0f}")
    return row


def row_convert():
    d = _json("convert_cpu.json")
    if d is None:
        return None
    by = {int(r["tp"]): r for r in d["rows"]}
    one, two = by[1], by.get(2)
    text = (f"bucketed HF iterator at TP=1 {one['iter_gb_s']:.1f} GB/s (hands out views) vs {one['memcpy_gb_s']:.1f} "
            f"GB/s plain memory copy")
    if two:
        text += (f"; at TP=2 {two['iter_gb_s']:.2f} GB/s, bounded by gloo's all-gather on CPU "
                 f"({float(two['gloo_gather_floor_s']):.1f} s for the bare gather)")
    return (f"weight streaming (Qwen3-0.6B shape, {one['bytes'] / 1e9:.1f} GB {one['dtype'].replace('float', 'fp')})",
            _command(d["command"]), text + f"; at load ~{d['machine']['load_avg_1m_at_start']:.0f}")


def test_tiers_block() -> str:
    """The tier table: each tier's command, count, wall time against its budget, and the load."""
    d = _json("test_suite_cpu.json")
    if d is None:
        return "(not measured yet: `python -m benchmarks.tools.test_suite`)"
    lines = ["Measured with `python -m benchmarks.tools.test_suite --update-results` on the 2-core machine:", "",
             "| command | tests | wall time (budget) | load | commit |", "|---|---|---|---|---|"]
    for name in ("unit", "readme", "system", "ci"):
        t = d["tiers"].get(name)
        if t is None:
            continue
        budget = f" ({t['budget_s'] / 60:.0f} min)" if t.get("budget_s") else ""
        within = f" (in `{t['within']}`)" if t.get("within") else ""
        lines.append(f"| `{t['command']}`{within} | {t['passed']} passed, {t['skipped']} skipped, "
                     f"{t['failed']} failed | "
                     f"{t['wall_s'] / 60:.1f} min{budget} | {t['load_1m_at_start']:.1f}-{t['load_1m_at_end']:.1f} | "
                     f"{t['commit'][:10]} |")
    return "\n".join(lines)


def _static(what: str, command: str, result: str) -> Row:
    """A row that reports what tests assert (no measurement file)."""
    return lambda: (what, command, result)


ROWS: list[Row] = [
    row_main_job,
    _rollout_row("rollout_hf_inprocess_cpu.json", "same job, in-process engine",
                 "python -m benchmarks.jobs.rollout_paths --only hf-inprocess",
                 lambda r: f" (generation {r['median_gen_s']:.3f} s)"),
    _rollout_row("rollout_router_cpu.json", "two engines behind SGLang's router",
                 "python -m benchmarks.jobs.rollout_paths --only router",
                 lambda r: " (one request per POST through the router)"),
    row_async,
    _static("SGLang path, every mode", "`python -m pytest tests/e2e/test_e2e_sglang.py`",
            "colocated and disaggregated at trainer TP 1 and 2: 5 syncs per run, rollout vs trainer log-probs within "
            "1e-5 at every step; 2 engines behind `sglang-router`; SIGKILLed and SIGSTOPped engines recovered with "
            "every sample exactly once"),
    row_chaos,
    row_weight_sync,
    row_ops,
    row_doctor,
    row_step0,
    _static("layouts agree", "`python -m pytest tests/e2e/test_e2e.py -k layouts`",
            "TP=2, PP=2 (with several micro-batches per step) and DP=2 reproduce TP=1's losses and gradient norms "
            "within 1e-5, and their HF exports within 1e-4"),
    row_logprob_support,
    row_kernel,
    row_kernel_support,
    row_trl,
    row_trl_qwen3vocab("grpo_vs_trl_qwen3vocab"),
    row_trl_qwen3vocab("grpo_vs_trl_qwen3vocab_p4"),
    _scaling_row("kernel", "log-prob kernel's working memory vs tokens T (H=256, V=151,936, fp32, fwd+bwd)"),
    _scaling_row("length", "GRPO step vs response length at V=151,936, mgrpo and TRL (TRL to 512 tokens)"),
    _scaling_row("prompts", "GRPO step vs prompts per step at V=151,936 (x 8 samples, 128 tokens), mgrpo and TRL",
                 image=False),
    _scaling_row("vocab", "GRPO step vs vocabulary size, mgrpo and TRL", image=False),
    _scaling_row("engines", "GRPO step vs rollout engines (SGLang-protocol CPU servers), mgrpo", image=False),
    _scaling_row("ranks", "GRPO step vs Megatron ranks (TP, DP over gloo), mgrpo", image=False, every_point=True),
    row_convert,
]


def results_block() -> str:
    lines = ["| what | command | result |", "|---|---|---|"]
    for row in ROWS:
        cells = row()
        if cells is not None:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def perf_block() -> str:
    """The last line of the performance history: each standing comparison's mgrpo/TRL ratios."""
    from benchmarks.tools.perf_history import last_line

    line = last_line(os.path.join(RESULTS, "perf_history.jsonl"))
    if line is None:
        return "(no line yet: `python -m benchmarks.tools.perf_history --update-results`)"
    out = [f"The last line of `benchmarks/results/perf_history.jsonl` (`python -m benchmarks.tools.perf_history "
           f"--update-results`): commit {line['commit']}, {line['date_utc'][:10]}, load "
           f"{line['load_1m_at_start']:.1f}-{line['load_1m_at_end']:.1f}. Ratios are mgrpo / TRL; lower is better.", "",
           "| comparison | median step | peak PSS | response tokens/s | time to first step (mgrpo, TRL) |",
           "|---|---|---|---|---|"]
    for name, what in (("tiny", "tiny workload, lockstep"), ("qwen3vocab", "Qwen3 vocabulary, 2 prompts x 8")):
        r = line.get(name)
        if not r:
            continue
        if "error" in r:
            out.append(f"| {what} | failed: {r['error'][:80]} | | | |")
            continue
        out.append(f"| {what} | {r['step_ratio']:.2f}x ({r['mgrpo_median_step_s']:.3f} vs {r['trl_median_step_s']:.3f} s)"
                   f" | {r['pss_ratio']:.2f}x ({r['mgrpo_peak_pss_mib']:,.0f} vs {r['trl_peak_pss_mib']:,.0f} MiB) | "
                   f"{r['response_tokens_per_s_ratio']:.2f}x | {r['mgrpo_time_to_first_step_s']:.1f} s, "
                   f"{r['trl_time_to_first_step_s']:.1f} s |")
    k = line.get("kernel")
    if k and "error" not in k:
        out += ["", f"Kernel (T=1024, H=1024, V=151,936, fp32, fwd+bwd): chunked {k['chunked_median_s']:.2f} s / "
                    f"{k['chunked_peak_extra_mib']:,.0f} MiB vs full logits {k['naive_median_s']:.2f} s / "
                    f"{k['naive_peak_extra_mib']:,.0f} MiB."]
    return "\n".join(out)


BLOCKS = {"main-job": main_job_block, "learning-main": learning_main_block, "learning": learning_block, "plan": plan_block, "results": results_block, "test-tiers": test_tiers_block,
          "perf": perf_block}


PAGES = {"README.md": ("learning-main",), "docs/results.md": ("learning", "main-job", "results", "perf"), "docs/scale-and-planning.md": ("plan",),
         "docs/development.md": ("test-tiers",)}
"""Each page (relative to the repository) and the blocks it holds."""


def render(text: str, names=tuple(BLOCKS), page: str = "README.md") -> str:
    """`text` (the page `page`) with each named block replaced by what the results files say; each block must be
    there once. Links to `benchmarks/...` are made relative to the page's folder."""
    up = os.path.relpath(REPO, os.path.dirname(os.path.join(REPO, page)))
    prefix = "" if up == "." else up + "/"
    for name in names:
        block = BLOCKS[name]
        pattern = re.compile(rf"(<!-- readme_table:{name} -->\n)(.*?)(\n<!-- /readme_table:{name} -->)", re.S)
        if len(pattern.findall(text)) != 1:
            raise ValueError(f"{page} must hold the block <!-- readme_table:{name} --> ... "
                             f"<!-- /readme_table:{name} --> exactly once")
        body = block().replace("](benchmarks/", f"]({prefix}benchmarks/")
        text = pattern.sub(lambda m: m.group(1) + body + m.group(3), text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the pages")
    ap.add_argument("--check", action="store_true", help="exit 1 when a page differs")
    args = ap.parse_args(argv)
    differs = False
    for page, names in PAGES.items():
        path = os.path.join(REPO, page)
        with open(path) as f:
            old = f.read()
        new = render(old, names, page)
        if new == old:
            print(f"{page} agrees with benchmarks/results/")
            continue
        if args.write:
            with open(path, "w") as f:
                f.write(new)
            print(f"{page} rewritten from benchmarks/results/")
            continue
        differs = True
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page,
                                                   f"{page} (rendered)"))
    return 1 if args.check and differs else 0


if __name__ == "__main__":
    sys.exit(main())
