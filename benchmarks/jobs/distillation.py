"""On-policy distillation against GRPO alone, from the same random start: the steps each needs until the mean
reward of the last 10 steps reaches 0.8, both curves, per seed; and the teacher's step-1 log-probs against the
teacher checkpoint's own transformers forward, per teacher mode (and for a teacher wider than the student).

The teacher is a model the main job trained (its HF export):
    mgrpo-train trainer.experiment_name=opd-teacher          # -> outputs/mgrpo/opd-teacher/hf
    python -m benchmarks.jobs.distillation --teacher outputs/mgrpo/opd-teacher/hf --seeds 1 2 3
    python -m benchmarks.jobs.distillation --seeds 1 --distill-steps 60 --skip-agreement \
        --reuse benchmarks/results/distillation_cpu.json --variant 'NAME: OVERRIDES' ...   # what else a user tries

Writes benchmarks/results/distillation_cpu.json (with --update-results; else outputs/benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import REPO, add_output_args, write_json
from benchmarks.tools.proctree import machine

TARGET = 0.8
REWARD = "critic/score/mean"
DEFAULT_VARIANT = ("forward_kl_topk: algorithm.adv_estimator=none algorithm.opd.loss_mode=forward_kl_topk "
                   "algorithm.opd.topk=8 actor.lr=2e-3")
"""Pure distillation over the teacher's top 8 log-probs at every position (the vocabulary has 16 tokens), at 4x the
main job's learning rate: a dense signal takes it (the GRPO curves keep the main job's 5e-4)."""


RAY_START_TRIES = 3
"""Starts of one run when Ray's node does not come up in its fixed 30 s (a loaded shared machine); each counted."""
RAY_TIMEOUT = "The current node timed out during startup"
ray_retries = 0


def run(overrides: list[str], run_dir: str) -> list[dict]:
    """One mgrpo-train run; its step metrics."""
    global ray_retries
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}", "trainer.save_hf=false",
           *overrides]
    for attempt in range(RAY_START_TRIES):
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=3600)
        if proc.returncode == 0 or RAY_TIMEOUT not in proc.stdout or attempt == RAY_START_TRIES - 1:
            break
        ray_retries += 1
        print(f"Ray's node did not start in time; starting the run again ({attempt + 2}/{RAY_START_TRIES})", flush=True)
    if proc.returncode != 0:
        sys.exit(f"mgrpo-train {' '.join(overrides)} exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if REWARD in m]


def steps_to(rewards: list[float], target: float = TARGET):
    """The first step whose last 10 rewards average at least `target` (None: never)."""
    for i in range(10, len(rewards) + 1):
        if sum(rewards[i - 10:i]) / 10 >= target:
            return i
    return None


def curve(name: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="mgrpo-distill-") as tmp:
        t0 = time.time()
        steps = run(overrides, tmp)
        wall = time.time() - t0
    rewards = [m[REWARD] for m in steps]
    out = {"name": name, "command": "mgrpo-train " + " ".join(overrides), "steps": len(steps),
           "steps_to_0.8": steps_to(rewards), "reward_last10": sum(rewards[-10:]) / min(10, len(rewards)),
           "rewards": [round(r, 4) for r in rewards], "wall_s": round(wall, 1)}
    if "opd/reverse_kl" in steps[0]:
        out["reverse_kl"] = [round(m["opd/reverse_kl"], 4) for m in steps]
    print(f"{name}: {len(steps)} steps, last-10 {out['reward_last10']:.3f}, steps to {TARGET}: {out['steps_to_0.8']}, "
          f"{wall:.0f} s", flush=True)
    return out


def agreement(teacher: str, mode: str, extra: list[str]) -> dict:
    """One step with the teacher; its step-1 log-probs of every sampled token against a transformers forward of
    the teacher checkpoint over prompt + response (the largest absolute difference)."""
    import torch
    from transformers import AutoModelForCausalLM

    overrides = [f"teacher.hf_path={teacher}", f"teacher.mode={mode}", "trainer.total_training_steps=1",
                 "trainer.log_token_logprobs=true", *extra]
    with tempfile.TemporaryDirectory(prefix="mgrpo-distill-") as tmp:
        run(overrides, tmp)
        with open(os.path.join(tmp, "trajectories.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    worst, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            p, r = row["prompt_ids"], row["response_ids"]
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            worst = max(worst, float((want - torch.tensor(row["teacher_logprobs"])).abs().max()))
            tokens += len(r)
    print(f"teacher.mode={mode} {' '.join(extra)}: max |teacher log-prob - transformers| = {worst:.2e} over "
          f"{tokens} tokens", flush=True)
    return {"mode": mode, "command": "mgrpo-train " + " ".join(overrides), "max_abs_diff": worst, "tokens": tokens}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name: key=value key=value' -> (name, overrides)."""
    name, _, rest = text.partition(":")
    return name.strip(), rest.split()


def reused(previous: list[dict], command: str):
    """A curve of an earlier result whose command was this one (the same overrides, seed included), or None."""
    return next((c for c in previous if c.get("command") == command), None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="outputs/mgrpo/opd-teacher/hf")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--grpo-steps", type=int, default=150)
    ap.add_argument("--distill-steps", type=int, default=75, help="at most half of --grpo-steps")
    ap.add_argument("--variant", action="append", default=None, metavar="'NAME: OVERRIDES'",
                    help="a distillation curve's name and overrides besides the teacher (repeatable; default: "
                         "forward_kl_topk, pure)")
    ap.add_argument("--skip-agreement", action="store_true", help="the curves only")
    ap.add_argument("--skip-curves", action="store_true", help="the teacher agreement only")
    ap.add_argument("--reuse", default=None, help="an earlier result JSON: curves with the same command are taken "
                                                  "from it, not run again (marked reused)")
    add_output_args(ap, "distillation_cpu")
    args = ap.parse_args(argv)
    teacher = os.path.abspath(args.teacher)
    if not os.path.isfile(os.path.join(teacher, "config.json")):
        sys.exit(f"--teacher {args.teacher}: no config.json there (train it: mgrpo-train "
                 "trainer.experiment_name=opd-teacher)")
    variants = [parse_variant(v) for v in (args.variant or [DEFAULT_VARIANT])]
    previous: list[dict] = []
    if args.reuse:
        with open(args.reuse) as f:
            old = json.load(f)
        previous = [c for s in old.get("seeds", []) for c in [s.get("grpo"), *s.get("distillation", {}).values()]
                    if c]
    result: dict = {"command": "python -m benchmarks.jobs.distillation " + " ".join(argv or sys.argv[1:]),
                    "teacher": args.teacher, "target": TARGET, "agreement": [], "seeds": [], "summary": {}}

    def save():
        write_json(args, "distillation_cpu", {**result, "ray_start_retries": ray_retries,
                                              "machine": machine(packages=("torch", "megatron-core"))})

    def curve_or_reuse(name: str, overrides: list[str]) -> dict:
        got = reused(previous, "mgrpo-train " + " ".join(overrides))
        if got is not None:
            print(f"{name}: reused from {args.reuse}", flush=True)
            return {**got, "name": name, "reused": args.reuse}
        return curve(name, overrides)

    for seed in [] if args.skip_curves else args.seeds:
        same = [f"trainer.seed={seed}", f"data.seed={seed}", f"actor.seed={seed}"]
        row: dict = {"seed": seed, "distillation": {}}
        result["seeds"].append(row)
        row["grpo"] = curve_or_reuse(f"grpo seed {seed}", [*same, f"trainer.total_training_steps={args.grpo_steps}"])
        save()
        for name, extra in variants:
            row["distillation"][name] = curve_or_reuse(
                f"{name} seed {seed}", [*same, f"trainer.total_training_steps={args.distill_steps}",
                                        f"teacher.hf_path={teacher}", *extra])
            save()
    for name, _ in variants:  # steps to 0.8 per seed, and whether each seed took at most half of GRPO's
        per = [(r["grpo"]["steps_to_0.8"], r["distillation"][name]["steps_to_0.8"]) for r in result["seeds"]]
        result["summary"][name] = {
            "grpo_steps_to_0.8": [g for g, _ in per], "distill_steps_to_0.8": [d for _, d in per],
            "distill_last10": [round(r["distillation"][name]["reward_last10"], 3) for r in result["seeds"]],
            "at_most_half_of_grpo": all(d is not None and (g is None or d <= g / 2) for g, d in per)}
        print(f"{name}: steps to {TARGET} per seed {result['summary'][name]['distill_steps_to_0.8']} against GRPO "
              f"{result['summary'][name]['grpo_steps_to_0.8']}", flush=True)
    save()
    if args.skip_agreement:
        return
    for mode in ("megatron", "sglang"):
        result["agreement"].append(agreement(teacher, mode, []))
        save()
    with tempfile.TemporaryDirectory(prefix="mgrpo-wide-teacher-") as wide:  # a wider, deeper random teacher
        from mgrpo.config import ModelConfig
        from mgrpo.data.synthetic import synthetic_tokenizer
        from mgrpo.models.hf_io import init_hf_checkpoint

        init_hf_checkpoint(wide, ModelConfig(hidden_size=192, ffn_hidden_size=512, num_layers=3), seed=5,
                           tokenizer=synthetic_tokenizer())
        for mode in ("megatron", "sglang"):
            row = agreement(wide, mode, [])
            row["teacher"] = "random, hidden 192, ffn 512, 3 layers (the student: 128, 256, 2)"
            result["agreement"].append(row)
            save()

if __name__ == "__main__":
    main()
