"""Metrics of one step's experience, under the names veRL users read (metric names as in veRL)."""

from __future__ import annotations

import statistics


def summed(*parts: dict) -> dict:
    """One dict of several parts' metrics: a number under a key that more than one part measured adds up
    (the rounds of one batch, the restarts of generation, memory release and weight sync); anything else
    keeps the last part's value."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            number = isinstance(value, (int, float)) and isinstance(out.get(key), (int, float))
            out[key] = out[key] + value if number else value
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return float(statistics.fmean(xs)) if xs else 0.0


def experience_metrics(exp, *, max_response_length: int) -> dict:
    lengths = [len(r) for r in exp.response_ids]
    adv_tokens = [a for adv, keep in zip(exp.advantages or [], exp.in_loss) if keep for a in adv]
    sampled = exp.sampled_mask or [None] * len(exp)  # multi-turn context tokens have no engine log-prob
    diffs = [abs(a - b) for ro, old, m in zip(exp.rollout_logprobs, exp.old_logprobs or [], sampled)
             for k, (a, b) in enumerate(zip(ro, old)) if m is None or m[k]]
    scores = [s for s in exp.scores if s is not None]  # a sample without a reward is counted under reward/
    out = {
        "critic/score/mean": _mean(scores),
        "critic/score/max": max(scores, default=0.0),
        "critic/score/min": min(scores, default=0.0),
        "critic/rewards/mean": _mean(r for r in exp.rewards if r is not None),
        "critic/advantages/mean": _mean(adv_tokens),
        "critic/advantages/max": max(adv_tokens, default=0.0),
        "critic/advantages/min": min(adv_tokens, default=0.0),
        "response_length/mean": _mean(lengths),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/min": float(min(lengths, default=0)),
        "response_length/clip_ratio": _mean(f == "length" for f in exp.finish_reasons),
        "prompt_length/mean": _mean(len(p) for p in exp.prompt_ids),
        "rollout/samples": float(len(exp)),
        # Same tokens, same weights: the engine's log-probs and the trainer's should agree (bf16 and
        # kernel differences show up here first).
        "rollout/logprob_abs_diff": _mean(diffs),
        "rollout/logprob_abs_diff_max": max(diffs, default=0.0),
    }
    if exp.entropy:
        out["rollout/entropy"] = _mean(x for e in exp.entropy for x in e)
    if exp.support is not None:
        out.update(support_metrics(exp.support))
    return out


def support_metrics(supports) -> dict:
    """How much top-k / top-p cut (algorithm.logprob_support=sampled). A token whose support is one id was
    drawn with probability 1 and, over that support, carries no gradient at all: a share of them that
    grows towards 1 means the sampler has become greedy and the policy can no longer explore."""
    lens = [n for s in supports for n in s.lens]
    cut = [n for n in lens if n > 0]  # 0: nothing was cut, the whole vocabulary
    return {"rollout/support_size/mean": _mean(cut),
            "rollout/support_cut_frac": len(cut) / max(len(lens), 1),
            "rollout/support_single_frac": sum(n == 1 for n in cut) / max(len(lens), 1)}


def step_metrics(exp, metrics: dict, cfg, layout, train_data, counters: dict) -> dict:
    """What one step's experience and timing say, plus the run-long counters (`<name>_total`)."""
    out = experience_metrics(exp, max_response_length=cfg.data.max_response_length)
    tokens = sum(len(p) + len(r) for p, r in zip(exp.prompt_ids, exp.response_ids))
    out["perf/total_tokens"] = float(tokens)
    out["perf/throughput"] = tokens / max(metrics.get("timing_s/step", 1e-9), 1e-9) / layout.total
    out["data/filtered_prompts"] = float(train_data.num_filtered)
    out["data/epoch"] = float(train_data.epoch)
    for key, value in counters.items():
        out[key + "_total"] = float(value)
    out.update(exp.opd_metrics(cfg.algorithm.opd))  # on-policy distillation's signal ({} without a teacher)
    return out


REWARD_KEY = "critic/score/mean"
OUTPUTS = ("metrics.jsonl", "tensorboard", "trajectories.jsonl", "checkpoints", "hf")


def run_summary(run_dir: str) -> tuple[dict, str]:
    """What a run folder's metrics.jsonl says at the end: the last training step's metrics (with the validation
    logged at that step), and one line: steps, the mean reward over the first and last 10 steps, the time the
    steps were logged over (resumes included), and where the outputs are. ({}, '') for a folder with no steps."""
    import json
    import os

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}, ""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [m for m in lines if REWARD_KEY in m]
    if not steps:
        return {}, ""
    last = steps[-1]
    final = {k: v for m in lines if m["step"] == last["step"] for k, v in m.items() if k not in ("step", "time")}
    rewards = [m[REWARD_KEY] for m in steps]
    outputs = ", ".join(name + ("/" if os.path.isdir(os.path.join(run_dir, name)) else "")
                        for name in OUTPUTS if os.path.exists(os.path.join(run_dir, name)))
    line = (f"done | {len(steps)} steps | reward first-10 {_mean(rewards[:10]):.3f}, last-10 "
            f"{_mean(rewards[-10:]):.3f} | {lines[-1]['time'] - lines[0]['time']:.0f}s | {run_dir}: {outputs}")
    return final, line
