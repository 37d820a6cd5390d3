"""The report of `grpo_vs_trl.py`: per-step statistics of each side's lockstep runs, the phases both sides
share, the table and the CSV/JSON outputs (the parent process only; the children never import it)."""

from __future__ import annotations

import csv
import json
import os
import statistics

# ======================================================================================================
# parent: statistics
# ======================================================================================================
def per_step(res: dict, warmup: int) -> dict:
    """Timed steps of one run: step k lasts from its 'go' to the child's next 'ready' (k = warmup+1 .. total-1;
    the last step has no next 'ready', its end runs into shutdown)."""
    ready, go = res["gate"]["ready"], res["gate"]["go"]
    by_step = {s["step"]: s for s in res["steps"]}
    total = len(go)
    ks = list(range(warmup + 1, total))
    dts = [ready[k] - go[k - 1] for k in ks]
    resp = [by_step[k].get("response_tokens") or 0.0 for k in ks]
    tot = [by_step[k].get("total_tokens") or (by_step[k].get("response_tokens", 0.0) + by_step[k].get("prompt_tokens",
                                                                                                       0.0))
           for k in ks]
    phase_keys = sorted({key for k in ks for key, v in by_step[k].items() if isinstance(v, float)
                         and key not in ("score_mean", "response_tokens", "total_tokens", "samples", "prompt_tokens")})
    aligned = [aligned_phases(res["kind"], by_step[k], dt) for k, dt in zip(ks, dts)]
    return {
        "intervals_s": dts, "response_tokens": resp, "total_tokens": tot,
        "aligned": {key: statistics.median([a[key] for a in aligned]) for key in ALIGNED},
        "cpu_s": res["own_cpu"][warmup:total - 1],
        "scores": [by_step[k]["score_mean"] for k in sorted(by_step) if by_step[k].get("score_mean") is not None],
        "phases": {key: statistics.median([by_step[k].get(key, 0.0) for k in ks]) for key in phase_keys},
        "time_to_first_step_s": ready[0] - res["t_launch"],
    }


ALIGNED = ("generate", "reward", "old-policy log-probs", "reference log-probs", "update (fwd+bwd+optimizer)",
           "weight sync", "other")


def aligned_phases(kind: str, s: dict, interval: float) -> dict:
    """One step's time split into the same phases on both sides (seconds). 'other' is the rest of the measured
    step: TRL's tokenize/decode/advantages/logging/data loading, mgrpo's advantages, metrics, logs, trajectories."""
    g = s.get
    if kind == "trl":
        p = {"generate": g("gen", 0.0), "reward": g("reward", 0.0), "old-policy log-probs": 0.0,
             "reference log-probs": g("ref_forward", 0.0),
             "update (fwd+bwd+optimizer)": g("training_step", 0.0) - g("gen_score_ref", 0.0)
             + g("clip_and_optimizer", 0.0), "weight sync": 0.0}
    elif "timing_s/reward_wait" in s:
        # The reference forward runs on the ranks from the end of generation while a driver thread judges; the
        # loop waits for the forward (timing_s/ref) and then for what scoring took beyond it (reward_wait).
        p = {"generate": g("timing_s/gen", 0.0), "reward": g("timing_s/reward_wait", 0.0),
             "old-policy log-probs": g("timing_s/old_logprob", 0.0), "reference log-probs": g("timing_s/ref", 0.0),
             "update (fwd+bwd+optimizer)": g("timing_s/update_actor", 0.0),
             "weight sync": g("timing_s/update_weights", 0.0)}
    else:  # results written before the judge ran in a thread of its own
        # The reference forward runs on the ranks from the end of generation while the driver judges and
        # computes advantages; the update call waits for what is left of it (kept on the ranks), which is
        # counted here as reference log-probs, not as update.
        overlap = g("timing_s/reward", 0.0) + g("timing_s/adv", 0.0)
        ref_in_update = max(0.0, g("timing_s/ref_on_ranks", 0.0) - overlap)
        ref_in_update = min(ref_in_update, g("timing_s/update_actor", 0.0))
        p = {"generate": g("timing_s/gen", 0.0), "reward": g("timing_s/reward", 0.0),
             "old-policy log-probs": g("timing_s/old_logprob", 0.0),
             "reference log-probs": g("timing_s/ref", 0.0) + ref_in_update,
             "update (fwd+bwd+optimizer)": g("timing_s/update_actor", 0.0) - ref_in_update,
             "weight sync": g("timing_s/update_weights", 0.0)}
    p["other"] = interval - sum(p.values())
    return p


def summarize(kind: str, runs: list[dict], warmup: int, last_k: int) -> dict:
    ws = [per_step(r, warmup) for r in runs]
    dts = [d for w in ws for d in w["intervals_s"]]
    wall = sum(dts)
    n = len(dts)
    finals = [statistics.fmean(w["scores"][-last_k:]) for w in ws if w["scores"]]
    phase_keys = sorted({k for w in ws for k in w["phases"]})
    idle_wall = sum(r["idle_wall"] for r in runs)
    return {
        "framework": kind,
        "runs": len(runs),
        "timed_steps": n,
        "median_step_s": statistics.median(dts),
        "mean_step_s": statistics.fmean(dts),
        "stdev_step_s": statistics.stdev(dts) if n > 1 else 0.0,
        "p10_step_s": quantile(dts, 0.1),
        "p90_step_s": quantile(dts, 0.9),
        "median_step_s_per_run": [statistics.median(w["intervals_s"]) for w in ws],
        "response_tokens_per_s": sum(sum(w["response_tokens"]) for w in ws) / wall,
        "total_tokens_per_s": sum(sum(w["total_tokens"]) for w in ws) / wall,
        "response_tokens_per_step": sum(sum(w["response_tokens"]) for w in ws) / n,
        # mean, not median: CPU times tick in 10 ms steps, a median of per-step values would be quantised
        "cpu_s_per_step": statistics.fmean([c for w in ws for c in w["cpu_s"]]),
        "cpu_utilisation_in_step": sum(sum(w["cpu_s"]) for w in ws) / wall,
        "idle_background_cpu_cores": sum(r["idle_cpu"] for r in runs) / idle_wall if idle_wall else 0.0,
        "peak_rss_tree_mib": max(r["memory"]["peak_rss_tree_mib"] for r in runs),
        "peak_pss_tree_mib": max(r["memory"]["peak_pss_tree_mib"] for r in runs),
        "max_processes": max(r["memory"]["max_processes"] for r in runs),
        "final_reward": statistics.fmean(finals) if finals else float("nan"),
        "final_reward_per_run": finals,
        "time_to_first_step_s": statistics.median([w["time_to_first_step_s"] for w in ws]),
        "process_wall_s_per_run": [r["t_exit"] - r["t_launch"] for r in runs],
        "phase_medians_s": {k: statistics.median([w["phases"].get(k, 0.0) for w in ws]) for k in phase_keys},
        "aligned_phase_medians_s": {k: statistics.median([w["aligned"][k] for w in ws]) for k in ALIGNED},
        "memory_per_run": [r["memory"] for r in runs],
        "step_intervals_s_per_run": [w["intervals_s"] for w in ws],
        "cpu_s_per_step_per_run": [w["cpu_s"] for w in ws],
        "response_tokens_per_step_per_run": [w["response_tokens"] for w in ws],
        "reward_per_step_per_run": [w["scores"] for w in ws],
        "leftover_pids_after_exit": sorted({p for r in runs for p in r["leftover_pids"]}),
    }


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


TABLE = [
    ("median step time (s)", "median_step_s", "{:.3f}"),
    ("mean step time (s)", "mean_step_s", "{:.3f}"),
    ("p10 / p90 step time (s)", ("p10_step_s", "p90_step_s"), "{:.3f} / {:.3f}"),
    ("response tokens / s", "response_tokens_per_s", "{:.0f}"),
    ("total tokens / s", "total_tokens_per_s", "{:.0f}"),
    ("response tokens / step", "response_tokens_per_step", "{:.0f}"),
    ("CPU s / step, mean (tree)", "cpu_s_per_step", "{:.3f}"),
    ("CPU cores busy during a step", "cpu_utilisation_in_step", "{:.2f}"),
    ("CPU cores busy while idle", "idle_background_cpu_cores", "{:.3f}"),
    ("peak RSS, process tree (MiB)", "peak_rss_tree_mib", "{:.0f}"),
    ("peak PSS, process tree (MiB)", "peak_pss_tree_mib", "{:.0f}"),
    ("processes (max at once)", "max_processes", "{:d}"),
    ("start-up to step 1 (s)", "time_to_first_step_s", "{:.1f}"),
    ("final mean reward (last steps)", "final_reward", "{:.3f}"),
]


def render_table(trl: dict, mg: dict) -> str:
    def cell(s, key, spec):
        return spec.format(*(s[k] for k in key)) if isinstance(key, tuple) else spec.format(s[key])

    def ratio(key):
        if isinstance(key, tuple) or abs(trl[key]) < 1e-2:
            return ""
        return f"{mg[key] / trl[key]:.2f}x"

    w = 32
    lines = [f"{'':{w}} {'TRL GRPOTrainer':>16} {'mgrpo':>16} {'mgrpo/TRL':>10}"]
    lines += [f"{label:{w}} {cell(trl, key, spec):>16} {cell(mg, key, spec):>16} {ratio(key):>10}"
              for label, key, spec in TABLE]
    lines.append("\nwhere a step's time goes, median s per timed step (same phases on both sides):")
    for k in ALIGNED:
        a, b = trl["aligned_phase_medians_s"][k], mg["aligned_phase_medians_s"][k]
        lines.append(f"  {k:{w - 2}} {a:16.4f} {b:16.4f} {f'{b / a:.2f}x' if a > 1e-3 else '':>10}")
    for s, title in ((trl, "TRL phases (stopwatches around GRPOTrainer methods)"),
                     (mg, "mgrpo phases (its timing_s/* metrics)")):
        lines.append(f"\n{title}, median s per timed step:")
        lines += [f"  {k:34} {v:.4f}" for k, v in s["phase_medians_s"].items()]
    for s in (trl, mg):
        lines.append(f"\n{s['framework']} processes (first run): kind, count, sum of their peak RSS / PSS in MiB")
        for k, v in s["memory_per_run"][0]["by_process_kind"].items():
            lines.append(f"  {k:36} {v['processes']:3d} {v['peak_rss_mib']:8.0f} {v['peak_pss_mib']:8.0f}")
    return "\n".join(lines)


# ======================================================================================================
# parent: outputs
# ======================================================================================================
CSV_KEYS = ["median_step_s", "mean_step_s", "stdev_step_s", "p10_step_s", "p90_step_s", "response_tokens_per_s",
            "total_tokens_per_s", "response_tokens_per_step", "cpu_s_per_step", "cpu_utilisation_in_step",
            "idle_background_cpu_cores", "peak_rss_tree_mib", "peak_pss_tree_mib", "max_processes",
            "time_to_first_step_s", "final_reward", "timed_steps", "runs"]


def write_outputs(out: str, trl: dict, mg: dict, meta: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    ratios = {k: (mg[k] / trl[k] if abs(trl[k]) >= 1e-2 else None) for k in CSV_KEYS}
    with open(out + ".csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["framework"] + CSV_KEYS)
        for s in (trl, mg):
            wr.writerow([s["framework"]] + [round(s[k], 6) if isinstance(s[k], float) else s[k] for k in CSV_KEYS])
        wr.writerow(["ratio_mgrpo_over_trl"] + ["" if ratios[k] is None else round(ratios[k], 4) for k in CSV_KEYS])
    with open(out + ".json", "w") as f:
        json.dump({**meta, "results": {"trl": trl, "mgrpo": mg}, "ratios_mgrpo_over_trl": ratios}, f, indent=1,
                  default=str)
