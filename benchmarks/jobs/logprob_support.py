"""algorithm.logprob_support: how far `full` and `sampled` are apart under top-k / top-p, and the
default job learning with `sampled`.

    python -m benchmarks.jobs.logprob_support                # every run below (~40 min on 2 shared cores)
    python -m benchmarks.jobs.logprob_support --only full-k20p09,sampled-k20p09

Runs (each `mgrpo-train rollout=hf_cpu ...` to the end, 150 steps):
  sampled-k5p09[-tp2|-cp2]   top_k=5, top_p=0.9, logprob_support=sampled at TP 1, TP 2, CP 2 (packed):
                             step-1 rollout/logprob_abs_diff and actor/ppo_kl, mean reward first/last 10
  full-k5p09[-seedS], sampled-k5p09-seedS  the same setting, full vs sampled, seeds 1 (default), 2, 3
  {full,sampled}-k20p09[-seedS]  top_k=20 (more than the 16-token vocabulary: top_p does the cutting),
                             top_p=0.9, logprob_support full vs sampled, seeds 1, 2, 3: learning, step time
  sampled-k5p09-n16-t15[-sglang[-tp2|-cp2|-seedS]]  the same cut with rollout.n=16 and temperature 1.5,
                             in-process and on the default engine (the SGLang-protocol server)
  sampled-k5p09-sglang[-seedS]  the issue's command as is on the default engine, seeds 1-3
  sampled-k5p09-n16-lr3e4-sglang[-tp2|-cp2|-seedS]  the same with rollout.n=16 actor.lr=3e-4 (what makes it learn
                             on every seed), at TP 1, TP 2, CP 2 (packed); seeds 1-3
  Every *-sglang run of k5p09 also reports which answers its final policy can still draw under the cut
  (`reachable`): prompts whose answer is outside the support score 0 in every sample, so no group baseline
  gives them a gradient.
The bias of `full`, measured on policies of the k5p09 and k20p09 runs (the initial random one, and each
run's final one, at that run's top_k / top_p): the in-process engine samples the default job's prompts (every prompt, 32 samples each)
twice with the same seed, once returning full-distribution log-probs and once the behaviour log-probs
over each token's support, so every token has log pi_full(a) (what the trainer computes under `full`)
and log pi_sampled(a) (what actually sampled it). Reported: mean |log pi_full - log pi_sampled|
(= mean -log of the support's mass), the importance ratio pi_full / pi_sampled that `full` silently
applies to every token (mean, min, mean |r - 1|, share outside PPO's [0.8, 1.2]), the share of
tokens whose support was cut, and the mean support size.

Writes benchmarks/results/logprob_support_cpu.json (runs given with --only are merged into it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import machine

BASE = ["rollout=hf_cpu", "trainer.save_freq=0"]
RUNS = {
    "sampled-k5p09": ["rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=sampled"],
    "sampled-k5p09-tp2": ["rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=sampled", "actor.tp=2"],
    "sampled-k5p09-cp2": ["rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=sampled", "actor.cp=2",
                          "actor.pack_sequences=true"],
    "full-k5p09": ["rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=full"],
    "full-k20p09": ["rollout.top_k=20", "rollout.top_p=0.9", "algorithm.logprob_support=full"],
    "sampled-k20p09": ["rollout.top_k=20", "rollout.top_p=0.9", "algorithm.logprob_support=sampled"],
}
for _seed in (2, 3):  # is a gap between full and sampled the setting's, or one seed's?
    for _setting in ("k5p09", "k20p09"):
        for _mode in ("full", "sampled"):
            RUNS[f"{_mode}-{_setting}-seed{_seed}"] = RUNS[f"{_mode}-{_setting}"] + [
                f"trainer.seed={_seed}", f"data.seed={_seed}", f"actor.seed={_seed}"]
# What makes the top_k=5 job learn: more samples per prompt and a hotter sampler widen what a prompt group
# explores (the 5-of-16 cut leaves groups that all draw one wrong answer: advantage 0, no signal). On the
# default engine (the SGLang-protocol CPU server) as well as in-process.
EXPLORE = ["rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=sampled", "rollout.n=16",
           "rollout.temperature=1.5"]
RUNS["sampled-k5p09-n16-t15"] = EXPLORE
RUNS["sampled-k5p09-n16-t15-sglang"] = ["rollout=sglang_cpu", *EXPLORE]
RUNS["sampled-k5p09-n16-t15-sglang-tp2"] = ["rollout=sglang_cpu", *EXPLORE, "actor.tp=2"]
RUNS["sampled-k5p09-n16-t15-sglang-cp2"] = ["rollout=sglang_cpu", *EXPLORE, "actor.cp=2", "actor.pack_sequences=true"]
for _seed in (2, 3):
    RUNS[f"sampled-k5p09-n16-t15-sglang-seed{_seed}"] = ["rollout=sglang_cpu", *EXPLORE, f"trainer.seed={_seed}",
                                                         f"data.seed={_seed}", f"actor.seed={_seed}"]
# The issue's own command on the default engine (the SGLang-protocol server, whose top-p reads the whole
# distribution's mass), seeds 1-3; and what makes it learn there: more samples per prompt, a gentler step.
K5 = ["rollout=sglang_cpu", "rollout.top_k=5", "rollout.top_p=0.9", "algorithm.logprob_support=sampled"]
K5_LEARNS = [*K5, "rollout.n=16", "actor.lr=3e-4"]
RUNS["sampled-k5p09-sglang"] = K5
RUNS["sampled-k5p09-n16-lr3e4-sglang"] = K5_LEARNS
RUNS["sampled-k5p09-n16-lr3e4-sglang-tp2"] = [*K5_LEARNS, "actor.tp=2"]
RUNS["sampled-k5p09-n16-lr3e4-sglang-cp2"] = [*K5_LEARNS, "actor.cp=2", "actor.pack_sequences=true"]
for _seed in (2, 3):
    for _name, _base in (("sampled-k5p09-sglang", K5), ("sampled-k5p09-n16-lr3e4-sglang", K5_LEARNS)):
        RUNS[f"{_name}-seed{_seed}"] = [*_base, f"trainer.seed={_seed}", f"data.seed={_seed}", f"actor.seed={_seed}"]
REACH_RUNS = {name: (5, 0.9) for name in RUNS if name.startswith("sampled-k5p09-") and "-sglang" in name}
"""Runs whose final policy is asked which answers it can still draw (`reachable`)."""
BIAS_RUNS = {"full-k5p09": (5, 0.9), "sampled-k5p09": (5, 0.9), "full-k20p09": (20, 0.9), "sampled-k20p09": (20, 0.9)}


def overrides(name: str) -> list[str]:
    """BASE, less its rollout group where the run names its own."""
    own = [o for o in RUNS[name] if o.startswith("rollout=")]
    return [o for o in BASE if not (own and o.startswith("rollout="))] + RUNS[name]


def train(name: str, run_dir: str) -> dict:
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", *overrides(name)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: mgrpo-train exited {proc.returncode}:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "critic/score/mean" in m]
    rewards = [m["critic/score/mean"] for m in steps]
    times = sorted(m["timing_s/step"] for m in steps)
    out = {
        "command": "mgrpo-train " + " ".join(overrides(name)),
        "steps": len(steps),
        "reward_first10": sum(rewards[:10]) / 10,
        "reward_last10": sum(rewards[-10:]) / 10,
        "logprob_abs_diff_step1": steps[0]["rollout/logprob_abs_diff"],
        "logprob_abs_diff_max_step1": steps[0]["rollout/logprob_abs_diff_max"],
        "logprob_abs_diff_max_all_steps": max(m["rollout/logprob_abs_diff_max"] for m in steps),
        "ppo_kl_step1": steps[0]["actor/ppo_kl"],
        "entropy_step1": steps[0]["actor/entropy"],
        "entropy_last": steps[-1]["actor/entropy"],
        "median_step_s": times[len(times) // 2],
        "wall_s": time.time() - t0,
    }
    print(f"{name}: first-10 {out['reward_first10']:.3f} last-10 {out['reward_last10']:.3f} step-1 logprob diff "
          f"{out['logprob_abs_diff_step1']:.2e} ppo_kl {out['ppo_kl_step1']:.2e} median step "
          f"{out['median_step_s']:.3f} s", flush=True)
    return out


def bias(hf_dir: str, top_k: int, top_p: float, samples: int = 32) -> dict:
    """log pi_full(a) - log pi_sampled(a) of tokens the engine samples at (top_k, top_p) from `hf_dir`."""
    import torch

    from mgrpo.config import MGRPOConfig
    from mgrpo.data import PromptDataset, synthetic_tokenizer
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    cfg = MGRPOConfig()
    tok = synthetic_tokenizer()
    prompts = [it.prompt_ids for it in PromptDataset(cfg.data, tok).items]
    engine = HFRolloutEngine(hf_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    reqs = [GenerateRequest(uid=i, prompt_ids=p) for i, p in enumerate(p for p in prompts for _ in range(samples))]
    sp = SamplingParams(temperature=cfg.rollout.temperature, top_k=top_k, top_p=top_p,
                        max_new_tokens=cfg.data.max_response_length, seed=0)
    full = engine.generate(reqs, sp)
    sampled = engine.generate(reqs, SamplingParams(**{**sp.__dict__, "return_support": True}))
    assert all(a.token_ids == b.token_ids for a, b in zip(full, sampled)), "same seed, same tokens"
    lf = torch.tensor([x for r in full for x in r.logprobs], dtype=torch.float64)
    ls = torch.tensor([x for r in sampled for x in r.logprobs], dtype=torch.float64)
    sizes = torch.tensor([cfg.model.vocab_size if s is None else len(s) for r in sampled for s in r.support])
    ratio = torch.exp(lf - ls)  # pi_full / pi_behaviour = the support's mass under the full distribution
    return {
        "tokens": int(lf.numel()),
        "mean_abs_logprob_diff": (lf - ls).abs().mean().item(),
        "max_abs_logprob_diff": (lf - ls).abs().max().item(),
        "ratio_mean": ratio.mean().item(),
        "ratio_min": ratio.min().item(),
        "ratio_mean_abs_dev": (ratio - 1).abs().mean().item(),
        "ratio_outside_clip_0.2": ((ratio < 0.8) | (ratio > 1.2)).double().mean().item(),
        "tokens_cut": (sizes < cfg.model.vocab_size).double().mean().item(),
        "mean_support_size": sizes.double().mean().item(),
        "vocab_size": cfg.model.vocab_size,
    }


def reachable(hf_dir: str, top_k: int, top_p: float, temperature: float = 1.0) -> dict:
    """Which answers the policy in `hf_dir` can still draw under SGLang's cut (the default engine's): per
    prompt of the sum task, the probability mu(answer) * mu(EOS | answer) of the one rewarded response under
    the truncated, renormalised sampler, and whether it is 0 because the answer (or the EOS after it) lies
    outside its token's support. A group of such a prompt always scores 0: its advantage is 0 under every
    group baseline, so only what the model learns on other prompts can bring the answer into the support."""
    import torch
    from transformers import AutoModelForCausalLM

    from mgrpo.config import MGRPOConfig
    from mgrpo.data import PromptDataset, synthetic_tokenizer
    from mgrpo.rollout.sampler import truncate

    cfg = MGRPOConfig()
    tok = synthetic_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def mu(ids: list[int], target: int) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        weights, order = truncate(torch.softmax(logits / temperature, -1), top_k, top_p)
        kept = dict(zip(order.tolist(), (weights / weights.sum()).tolist()))
        return kept.get(target, 0.0)

    per_prompt = {}
    for it in PromptDataset(cfg.data, tok).items:
        answer = tok.encode(it.ground_truth)
        p_answer, ids = 1.0, list(it.prompt_ids)
        for t in answer:
            p_answer *= mu(ids, t)
            ids.append(t)
        per_prompt[it.prompt_text] = {"mu_answer": p_answer, "mu_correct": p_answer * mu(ids, tok.eos_token_id)}
    unreachable = [p for p, v in per_prompt.items() if v["mu_correct"] == 0.0]
    return {"prompts": len(per_prompt), "unreachable": unreachable,
            "answer_outside_support": [p for p, v in per_prompt.items() if v["mu_answer"] == 0.0],
            "expected_reward": sum(v["mu_correct"] for v in per_prompt.values()) / len(per_prompt),
            "per_prompt": per_prompt}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma list of runs (default: all): " + ", ".join(RUNS))
    add_output_args(ap, "logprob_support_cpu.json")
    args = ap.parse_args(argv)
    args.out = output_path(args, "logprob_support_cpu.json")
    names = args.only.split(",") if args.only else list(RUNS)
    result = {"runs": {}, "bias": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result.update(json.load(f))
    load_before = os.getloadavg()
    merging = args.only is not None and "loadavg_before" in result  # the file's load stays its first runs'

    with tempfile.TemporaryDirectory(prefix="mgrpo-logprob-support-") as tmp:
        for name in names:
            run_dir = os.path.join(tmp, name)
            result["runs"][name] = train(name, run_dir)
            if name in BIAS_RUNS:
                top_k, top_p = BIAS_RUNS[name]
                for policy, hf_dir in (("initial policy", "init_hf"), (f"final policy of {name}", "hf")):
                    key = f"top_k={top_k} top_p={top_p}, {policy}"
                    v = result["bias"][key] = bias(os.path.join(run_dir, hf_dir), top_k, top_p)
                    print(f"  bias at {key}: mean |dlogp| {v['mean_abs_logprob_diff']:.4f}, ratio mean "
                          f"{v['ratio_mean']:.4f} min {v['ratio_min']:.4f}, outside [0.8, 1.2] "
                          f"{v['ratio_outside_clip_0.2']:.3f}, cut {v['tokens_cut']:.3f}", flush=True)
            if name in REACH_RUNS:
                v = result["runs"][name]["reachable"] = reachable(os.path.join(run_dir, "hf"), *REACH_RUNS[name])
                print(f"  final policy: {len(v['unreachable'])} of {v['prompts']} prompts can no longer draw their "
                      f"answer ({len(v['answer_outside_support'])} with the answer outside the first token's "
                      f"support); expected reward under the cut {v['expected_reward']:.3f}", flush=True)
    if merging:
        for name in names:
            result["runs"][name]["loadavg_1min"] = f"{load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    else:
        result["loadavg_before"] = list(load_before)
        result["loadavg_after"] = list(os.getloadavg())
    result["machine"] = machine(packages=("torch", "ray", "megatron-core", "transformers"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
