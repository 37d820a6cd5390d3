"""`mgrpo-doctor run <run folder>`: how the engine/trainer log-prob difference is distributed in a run.

From the trajectory lines that carry token log-probs: the distribution of |rollout - trainer| per token and
per sequence (mean over its tokens), over steps; the worst sequences with their tokens and the position of
their worst token; and whether the difference concentrates by response position, by token id, by response
length or by engine. A dimension "concentrates" when one of its groups, holding at least 1% of the tokens
(and 20 of them, and at most half), has a median difference at least CONCENTRATED times that of all other tokens (medians: one
outlier token, which the worst sequences show, does not make a group): a bf16 engine or a
kernel difference spreads over everything, while a RoPE fault grows with position, a broken embedding row
shows on its token, and one stale engine shows on that engine. The per-step means are checked against the
run's own `rollout/logprob_abs_diff` in metrics.jsonl, so what the doctor read is what the run measured.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Optional

import numpy as np

from mgrpo.config.schema import MAX_LOGPROB_DIFF_DEFAULTS
from mgrpo.doctor import DoctorError
from mgrpo.doctor.trajectories import TokenLine, read_token_lines, trajectories_path

CONCENTRATED = 2.0
"""A group whose median difference is this many times the rest's is where the mismatch concentrates (against the
rest, not the whole, which a group of half the tokens could never double)."""
AGREE_BELOW = 5e-6
"""Differences whose group medians all stay under this are rounding, not a mismatch with a place: a float32
log-prob near -10 has a last bit of 9.5e-7, and two correct float32 programs differ by a few of them. No
dimension is called concentrated then, whatever the ratios of such small numbers."""
MIN_SHARE, MIN_TOKENS = 0.01, 20
MAX_SHARE = 0.5
"""A group counts only with at least MIN_SHARE of the tokens and MIN_TOKENS of them (else it is noise), and at
most half of them: a mismatch concentrates in a minority (one engine of two holds exactly half)."""
WORST = 5


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"count": 0}
    return {"count": int(x.size), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99)), "max": float(x.max())}


def _bucket(n: int) -> str:
    """0, 1, 2-3, 4-7, 8-15, ...: position and length groups that stay few on long responses."""
    if n < 2:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


def _bucket_order(key: str) -> int:
    return int(key.split("-")[0])


def _ratio(a: float, b: Optional[float]) -> float:
    if b is None:
        return 1.0
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def _groups(values: dict, *, order=None) -> dict:
    """{key: [diffs]} -> each group's median difference against the median of all other tokens, the verdict."""
    keys = list(values)
    arrays = [np.asarray(values[k], dtype=np.float64) for k in keys]
    everything = np.concatenate(arrays)
    count = everything.size
    rows, start = [], 0
    for key, arr in zip(keys, arrays):
        rest = np.concatenate([everything[:start], everything[start + arr.size:]])
        start += arr.size
        rows.append({"group": key, "tokens": int(arr.size), "share": arr.size / count, "mean": float(arr.mean()),
                     "median": float(np.median(arr)),
                     "ratio": _ratio(float(np.median(arr)), float(np.median(rest)) if rest.size else None)})
    rows.sort(key=(lambda r: order(r["group"])) if order else (lambda r: -r["ratio"]))
    counted = [r for r in rows if MIN_SHARE <= r["share"] <= MAX_SHARE and r["tokens"] >= MIN_TOKENS]
    top = max(counted, key=lambda r: r["ratio"], default=None)
    agree = max(r["median"] for r in rows) < AGREE_BELOW
    verdict = {"concentrated": bool(top and len(rows) > 1 and top["ratio"] >= CONCENTRATED and not agree),
               "agree": agree, "group": top["group"] if top else None, "ratio": top["ratio"] if top else None}
    return {"groups": rows, **verdict}


def _metric_by_step(run_dir: str) -> dict[int, float]:
    path = os.path.join(run_dir, "metrics.jsonl")
    out: dict[int, float] = {}
    if os.path.isfile(path):
        with open(path) as f:
            for raw in f:
                try:
                    row = json.loads(raw)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: the trajectories, not the metrics, are what is analysed
                if "rollout/logprob_abs_diff" in row and "step" in row:
                    out[int(row["step"])] = float(row["rollout/logprob_abs_diff"])
    return out


def analyse(run_dir: str) -> dict:
    """The report of a run folder as plain data (what `render` prints and `--json` writes)."""
    path = trajectories_path(run_dir)
    lines, without = read_token_lines(path)
    if not lines:
        raise DoctorError(f"{path} has no token log-probs ({without} lines without them): run with "
                          "trainer.log_token_logprobs=true")
    per_line = [np.asarray(t.diffs, dtype=np.float64) for t in lines]
    finite = [d[np.isfinite(d)] for d in per_line]
    tokens = np.concatenate(finite) if finite else np.zeros(0)
    # multi-turn context tokens (tool replies, template tokens) have no engine log-prob: not a failure
    nonfinite = int(sum(d.size - f.size for d, f in zip(per_line, finite))) - sum(t.context_tokens for t in lines)
    if tokens.size == 0:
        raise DoctorError(f"{path}: no response token has a finite log-prob on both sides")
    seq_means = np.asarray([f.mean() for f in finite if f.size])

    by_step: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(lines):
        by_step[t.step].append(i)
    metric = _metric_by_step(run_dir)
    steps = []
    for step in sorted(by_step):
        idx = by_step[step]
        x = np.concatenate([finite[i] for i in idx])
        row = {"step": step, "sequences": len(idx), **_stats(x),
               "seq_mean_max": float(max((finite[i].mean() for i in idx if finite[i].size), default=0.0))}
        if step in metric:
            row["metric"] = metric[step]
        steps.append(row)
    checked = [s for s in steps if "metric" in s and s["count"]]
    agreement = max((abs(s["mean"] - s["metric"]) / max(abs(s["metric"]), 1e-300) for s in checked), default=None)

    worst_idx = sorted((i for i in range(len(lines)) if finite[i].size),
                       key=lambda i: -float(np.nanmax(np.where(np.isfinite(per_line[i]), per_line[i], -1.0))))
    worst = [_sequence(lines[i], per_line[i]) for i in worst_idx[:WORST]]

    dims = {k: defaultdict(list) for k in ("position", "token", "length", "engine", "turn")}
    for t, d in zip(lines, per_line):
        for pos, (tok, x) in enumerate(zip(t.response_ids, d)):
            if math.isfinite(x):
                dims["position"][_bucket(pos)].append(x)
                dims["token"][str(tok)].append(x)
                dims["length"][_bucket(len(t.response_ids))].append(x)
                dims["engine"][str(t.engine)].append(x)
                if t.turn is not None:  # multi-turn: which assistant turn sampled it (later turns see more context)
                    dims["turn"][str(t.turn[pos])].append(x)
    concentration = {
        "position": _groups(dims["position"], order=_bucket_order),
        "token": _groups(dims["token"]),
        "length": _groups(dims["length"], order=_bucket_order),
        "engine": _groups(dims["engine"], order=str),
    }
    if dims["turn"]:
        concentration["turn"] = _groups(dims["turn"], order=int)
    dtype = run_setting(run_dir, "actor.dtype")
    worst_step = max(steps, key=lambda s: s.get("mean", 0.0))
    return {
        "run_dir": os.path.abspath(run_dir), "actor_dtype": dtype,
        "default_bound": MAX_LOGPROB_DIFF_DEFAULTS.get(dtype) if dtype else None,
        "worst_step": {"step": worst_step["step"], "mean": worst_step.get("mean")}, "trajectories": path, "lines": len(lines), "lines_without_tokens": without,
        "steps": len(steps), "first_step": steps[0]["step"], "last_step": steps[-1]["step"],
        "tokens": _stats(tokens), "nonfinite_tokens": nonfinite, "sequences": _stats(seq_means),
        "per_step": steps, "metric_agreement": agreement, "metric_steps_checked": len(checked),
        "worst": worst, "concentration": concentration, "next": next_command(run_dir, path, worst),
    }


def _sequence(t: TokenLine, d: np.ndarray) -> dict:
    pos = int(np.nanargmax(np.where(np.isfinite(d), d, -1.0)))
    return {"line": t.line, "step": t.step, "engine": t.engine, "weight_version": t.weight_version,
            "prompt_tokens": len(t.prompt_ids), "response_ids": t.response_ids, "response": t.response,
            "diffs": _finite(d), "rollout": _finite(t.rollout), "trainer": _finite(t.trainer),
            "sampled": t.sampled, "worst_position": pos, "worst_token": t.response_ids[pos], "max": float(d[pos]),
            "mean": float(np.nanmean(d)) if np.isfinite(d).any() else None}


def _finite(values) -> list:
    """Numbers, with None where there is none (a multi-turn context token, a log-prob the engine did not
    return): JSON has no NaN, and a reader should not have to tell a NaN of the data from one of the doctor."""
    return [float(x) if math.isfinite(x) else None for x in values]


def _cell(w: dict, k: int) -> str:
    """One token's |diff| in the worst-sequence listing: 'ctx' for a context token, which no engine sampled."""
    if w["sampled"] is not None and not w["sampled"][k]:
        return "ctx"
    return _g(w["diffs"][k])


def next_command(run_dir: str, path: str, worst: list[dict]) -> Optional[str]:
    """The `mgrpo-doctor layers` call that localises the worst sequence on the run's final weights (the same
    weights on both sides: what differs is the engine's model and the trainer's, not the weights)."""
    if not worst:
        return None
    engine = next((os.path.join(run_dir, d) for d in ("hf", "init_hf")
                   if os.path.isfile(os.path.join(run_dir, d, "config.json"))), None)
    if engine is None:
        return None
    temperature = run_setting(run_dir, "rollout.temperature")
    temp = f" --temperature {temperature:g}" if isinstance(temperature, (int, float)) and temperature not in (0, 1) \
        else ""
    return f"mgrpo-doctor layers --engine {engine} --trajectory {path} --line {worst[0]['line']}{temp}"


def run_setting(run_dir: str, key: str):
    """A config value of the run: from the fingerprint its latest checkpoint stores, else from the config.yaml
    the run folder holds (a run killed before its first checkpoint); None without either."""
    latest = os.path.join(run_dir, "checkpoints", "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            state = os.path.join(run_dir, "checkpoints", f.read().strip(), "trainer_state.json")
        try:
            with open(state) as f:
                return json.load(f).get("config", {}).get(key)
        except (OSError, json.JSONDecodeError):
            return None
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml")) as f:
            value = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


# --- text -----------------------------------------------------------------------------------------------
def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _pick_steps(steps: list[dict], rows: int = 12) -> list[dict]:
    if len(steps) <= rows:
        return steps
    every = {round(i * (len(steps) - 1) / (rows - 1)) for i in range(rows)}
    worst = max(range(len(steps)), key=lambda i: steps[i].get("max", 0.0))
    return [steps[i] for i in sorted(every | {worst})]


def render(r: dict) -> str:
    t, s = r["tokens"], r["sequences"]
    out = [f"mgrpo-doctor run {r['run_dir']}",
           f"  {r['lines']} sequences with token log-probs over {r['steps']} steps ({r['first_step']}..{r['last_step']}), "
           f"{t['count']} response tokens"
           + (f"; {r['lines_without_tokens']} lines without token log-probs" if r["lines_without_tokens"] else "")
           + (f"; {r['nonfinite_tokens']} tokens without a finite log-prob (left out)" if r["nonfinite_tokens"] else ""),
           "",
           "|rollout - trainer| log-prob   mean      p50       p90       p99       max",
           f"  per token                    {_g(t['mean']):9} {_g(t['p50']):9} {_g(t['p90']):9} {_g(t['p99']):9} "
           f"{_g(t['max'])}",
           f"  per sequence (its mean)      {_g(s['mean']):9} {_g(s['p50']):9} {_g(s['p90']):9} {_g(s['p99']):9} "
           f"{_g(s['max'])}"]
    ws = r["worst_step"]
    if r["default_bound"] is not None:
        out.append(f"  largest step mean {_g(ws['mean'])} (step {ws['step']}); the guard's default bound for "
                   f"actor.dtype={r['actor_dtype']} is {r['default_bound']:g} (trainer.max_logprob_diff)")
    if r["metric_agreement"] is not None:
        out.append(f"  per-step means equal metrics.jsonl's rollout/logprob_abs_diff within "
                   f"{r['metric_agreement']:.1e} (relative) over {r['metric_steps_checked']} steps")
    out += ["", "over steps      tokens   mean      p99       max       worst sequence mean"]
    for row in _pick_steps(r["per_step"]):
        out.append(f"  step {row['step']:<8} {row['count']:<8} {_g(row.get('mean')):9} {_g(row.get('p99')):9} "
                   f"{_g(row.get('max')):9} {_g(row['seq_mean_max'])}")
    out += ["", "worst sequences (largest token difference)"]
    for k, w in enumerate(r["worst"], 1):
        out.append(f"  {k}. line {w['line']}, step {w['step']}, engine {w['engine']}, {len(w['response_ids'])} "
                   f"response tokens after {w['prompt_tokens']} prompt tokens: worst at response position "
                   f"{w['worst_position']} (token {w['worst_token']}): rollout {w['rollout'][w['worst_position']]:.7g} "
                   f"trainer {w['trainer'][w['worst_position']]:.7g} |diff| {w['max']:.3g}")
        out.append(f"     tokens {w['response_ids'][:24]}{' ...' if len(w['response_ids']) > 24 else ''}")
        out.append(f"     |diff| [{', '.join(_cell(w, k) for k in range(min(len(w['diffs']), 24)))}"
                   f"{', ...' if len(w['diffs']) > 24 else ''}]")
    out += ["", f"where it concentrates (median |diff| of the group / of the other tokens; a group counts with "
                f"{MIN_SHARE:.0%} to {MAX_SHARE:.0%} of the tokens and >= {MIN_TOKENS}; concentrated at >= {CONCENTRATED:g}x)"]
    for dim, c in r["concentration"].items():
        shown = c["groups"] if dim != "token" else sorted(c["groups"], key=lambda g: -g["ratio"])[:6]
        cells = ", ".join(f"{g['group']}: {g['ratio']:.2g}x ({g['tokens']})" for g in shown[:10])
        more = f", ... ({len(c['groups'])} groups)" if len(c["groups"]) > len(shown[:10]) else ""
        if c["agree"]:
            verdict = f"agreement (every group's median |diff| under {AGREE_BELOW:g}: rounding)"
        elif c["concentrated"]:
            verdict = f"CONCENTRATED in {dim} {c['group']} ({c['ratio']:.2g}x)"
        elif len(c["groups"]) < 2:
            verdict = f"one {dim} only"
        else:
            verdict = f"spread (highest {_g(c['ratio'])}x)"
        out.append(f"  by {dim:9} {verdict}")
        out.append(f"             {cells}{more}")
    if r["next"]:
        weights = "final" if "/hf " in r["next"] else "initial"
        out += ["", f"localise the worst sequence layer by layer (on the run's {weights} weights, the same on both "
                    "sides: what differs is the engine's model and the trainer's):", f"  {r['next']}"]
    return "\n".join(out + ["", verdict_line(r)])


def verdict_line(r: dict) -> str:
    """The report in one line: do the engine and the trainer agree, by the bound the run's guard uses."""
    ws, bound = r["worst_step"], r["default_bound"]
    where = [f"{dim} {c['group']}" for dim, c in r["concentration"].items() if c["concentrated"]]
    if where:
        where_text = f"; concentrated in {', '.join(where)}"
    elif all(c["agree"] for c in r["concentration"].values()):
        where_text = f"; every token group agrees to under {AGREE_BELOW:g} (rounding)"
    else:
        where_text = "; spread over positions, tokens and engines"
    if ws["mean"] is None:
        return "verdict: NO DATA: no step has token log-probs of both sides"
    if bound is None:
        return (f"verdict: UNJUDGED: largest step mean |diff| {_g(ws['mean'])} (step {ws['step']}); the run folder "
                "names no actor.dtype, so there is no default bound to judge it by" + where_text)
    if ws["mean"] <= bound:
        return (f"verdict: AGREE: every step's mean |diff| is within the guard's bound (largest {_g(ws['mean'])} at "
                f"step {ws['step']} <= {bound:g} for actor.dtype={r['actor_dtype']})" + where_text)
    nxt = f"; next: {r['next']}" if r["next"] else ""
    return (f"verdict: DISAGREE: step {ws['step']}'s mean |diff| {_g(ws['mean'])} is over the guard's bound {bound:g} "
            f"for actor.dtype={r['actor_dtype']}" + where_text + nxt)
