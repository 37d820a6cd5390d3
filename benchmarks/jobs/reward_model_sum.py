"""A reward model as the only reward, on CPU: proof that the model path is real.

    python -m benchmarks.jobs.reward_model_sum                  # train the RM, then the default job on it
    python -m benchmarks.jobs.reward_model_sum -- trainer.total_training_steps=100   # extra mgrpo-train overrides

1. Trains a tiny reward model (a Qwen3-shaped sequence classifier, one score, on the synthetic tokenizer) on
   labelled responses of the sum task (the right sum then EOS 1.0; anything else 0, with many near misses: a
   number one or two off, the right sum cut off or followed by more); squared error on its score, about a minute
   on a CPU. Reported: held-out accuracy (score > 0.5 exactly for the right answers) and for how many prompts the
   right answer outscores every wrong number (what a policy could otherwise exploit).
   What it took (each a run of this script): a classifier trained with BCE scored every wrong answer about alike
   but not exactly, and GRPO's division by a group's small std made those differences full-size advantages: the
   run collapsed its entropy without learning (rule accuracy 0.0 at step 20). Partial credit for a wrong number
   with EOS (0.2) made "any number, then EOS" a plateau (rule 0.47 with no std division; 0.63 with a model that
   also preferred '5' for 2+4 and 3+3). So: no partial credit, and algorithm.norm_adv_by_std_in_grpo=false (the
   one change to the default job), under which the model's small differences between wrong answers stay small.
2. Runs the default job (`mgrpo-train`) with that model as its only reward (reward.models.rm on the CPU server's
   `/classify`, reward.compose={mgrpo/sum: {rm: 1.0}}), the rule's score computed beside it at weight 0.
3. Writes reward_model_sum_cpu.json (rule accuracy and model score, first and last 10 steps, per step; under
   outputs/benchmarks/, or benchmarks/results/ with --update-results) and reward_model_sum_cpu.png (both curves,
   when matplotlib is installed: the `bench` extra; without it a line says so). The trained reward model and the
   run folder stay in --work (default outputs/reward_model_sum/), whether the job ends well or not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

from benchmarks import REPO, add_output_args, add_work_args, fresh_work, output_path, pyplot_or_say

DIGITS = "0123456789"
JOB_OVERRIDES = ("algorithm.norm_adv_by_std_in_grpo=false",)
"""What the reward-model job changes of the default job (see the module docstring)."""


def labelled_responses(max_operand: int, rng: random.Random, n: int) -> list[tuple[str, float]]:
    """(prompt + response text, then '<eos>' when the response stopped; target score) pairs, 40% of them right:
    the right sum then EOS 1.0, anything else 0, with many near misses (a number one or two off, then EOS; the
    right sum cut off or followed by more)."""
    out: list[tuple[str, float]] = []
    while len(out) < n:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        right, prompt = str(a + b), f"{a}+{b}="
        if rng.random() < 0.4:
            out.append((prompt + right + "<eos>", 1.0))
            continue
        kind = rng.randrange(8)
        if kind <= 3:  # a wrong number, stopped: the answers a learning policy gives, often one or two off
            near = [v for v in range(a + b - 2, a + b + 3) if v >= 0 and v != a + b]
            wrong = str(rng.choice(near if kind <= 1 else [v for v in range(2 * max_operand + 3) if v != a + b]))
            out.append((prompt + wrong + "<eos>", 0.0))
        elif kind == 4:  # the right number, not stopped (cut off)
            out.append((prompt + right, 0.0))
        elif kind == 5:  # the right number, then more
            out.append((prompt + right + "".join(rng.choices(DIGITS + "+=", k=rng.randint(1, 3)))
                        + rng.choice(["<eos>", ""]), 0.0))
        else:  # anything
            text = "".join(rng.choices(DIGITS + "+=", k=rng.randint(0, 4)))
            stop = rng.choice(["<eos>", ""])
            if text == right or (stop and text.isdigit()):
                continue  # graded above
            out.append((prompt + text + stop, 0.0))
    return out


RM_STEPS = 2000
"""Reward-model training steps: 1200 ranked the right sum first for 24 of 25 prompts on an AMD EPYC machine (25 on
the Intel Xeon it was tuned on), 2000 for all 25 on both."""


def train_reward_model(out_dir: str, *, seed: int = 0, steps: int = RM_STEPS, max_operand: int = 4) -> dict:
    """Train and save the reward model (HF checkpoint + the synthetic tokenizer); its held-out accuracy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses to thread hand-offs (and the machine is shared)
    try:
        return _train(out_dir, seed=seed, steps=steps, max_operand=max_operand)
    finally:
        torch.set_num_threads(threads)


def _train(out_dir: str, *, seed: int, steps: int, max_operand: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from mgrpo.data.synthetic import synthetic_tokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = synthetic_tokenizer()
    model = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_labels=1, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, tie_word_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)

    def encode(texts):  # right-padded batch; the model pools at the last non-pad token
        ids = [tok(t.replace("<eos>", ""), add_special_tokens=False)["input_ids"] + ([1] if t.endswith("<eos>") else [])
               for t in texts]
        width = max(len(x) for x in ids)
        return torch.tensor([x + [0] * (width - len(x)) for x in ids]), torch.tensor(
            [[1] * len(x) + [0] * (width - len(x)) for x in ids])

    held_out = labelled_responses(max_operand, random.Random(seed + 1), 500)
    t0 = time.perf_counter()
    model.train()
    for _ in range(steps):
        batch = labelled_responses(max_operand, rng, 128)
        x, mask = encode([t for t, _ in batch])
        y = torch.tensor([target for _, target in batch])
        score = model(input_ids=x, attention_mask=mask).logits[:, 0]
        loss = torch.nn.functional.mse_loss(score, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        x, mask = encode([t for t, _ in held_out])
        pred = model(input_ids=x, attention_mask=mask).logits[:, 0] > 0.5
        # what the policy can exploit: for how many prompts does some wrong number outscore the right one?
        prompts = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        texts = [f"{a}+{b}={v}<eos>" for a, b in prompts for v in range(2 * max_operand + 3)]
        x, mask = encode(texts)
        scores = model(input_ids=x, attention_mask=mask).logits[:, 0].view(len(prompts), -1)
    accuracy = float((pred == torch.tensor([target == 1.0 for _, target in held_out])).float().mean())
    ranked = sum(int(row.argmax()) == a + b for row, (a, b) in zip(scores, prompts)) / len(prompts)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"rm_train_s": seconds, "rm_steps": steps, "rm_heldout_accuracy": accuracy,
            "rm_right_answer_ranked_first": ranked, "rm_final_loss": float(loss.detach())}


def run_job(rm_dir: str, run_dir: str, overrides: list[str]) -> list[dict]:
    """mgrpo-train with the reward model as the only reward; the metrics of each step."""
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}",
           f"reward.models={{rm: {{hf_path: {rm_dir}, batch_size: 256}}}}", "reward.compose={mgrpo/sum: {rm: 1.0}}",
           *JOB_OVERRIDES, *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        if line.startswith("step "):
            print(line, end="", flush=True)
        tail = (tail + [line])[-40:]
    if proc.wait() != 0:
        sys.exit(f"mgrpo-train exited {proc.returncode} (its run folder is kept: {run_dir}):\n" + "".join(tail))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "reward/rule/mean" in m]


def summarise(steps: list[dict]) -> dict:
    rule = [m["reward/rule/mean"] for m in steps]
    model = [m["reward/rm/mean"] for m in steps]
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    median = lambda key: median_of([m.get(key, 0.0) for m in steps])  # noqa: E731
    # The step's time split around scoring: the judge (rule + reward model) runs in a driver thread while the loop
    # waits for the reference forward (ref); reward_wait is what scoring took beyond it, so reward - reward_wait
    # is the part of scoring the forward hid.
    split = {f"median_{k}_s": median(f"timing_s/{k}") for k in ("reward", "reward_wait", "ref", "update_actor")}
    split["median_reward_hidden_s"] = median_of([m.get("timing_s/reward", 0.0) - m.get("timing_s/reward_wait", 0.0)
                                                 for m in steps])
    return {**split, "steps": len(steps), "rule_accuracy_first10": mean(rule[:10]),
            "rule_accuracy_last10": mean(rule[-10:]),
            "rm_score_first10": mean(model[:10]), "rm_score_last10": mean(model[-10:]),
            "rm_samples_per_s_median": sorted(m["reward/rm/samples_per_s"] for m in steps)[len(steps) // 2],
            "median_step_s": sorted(m["timing_s/step"] for m in steps)[len(steps) // 2],
            "failed_samples": sum(m.get("reward/masked_samples", 0) for m in steps),
            "rule_accuracy": rule, "rm_score": model}


def median_of(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def plot(result: dict, path: str) -> None:
    plt = pyplot_or_say(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(1, len(result["rule_accuracy"]) + 1)
    ax.plot(x, result["rule_accuracy"], label="rule accuracy (exact sum + EOS; weight 0)")
    ax2 = ax.twinx()
    ax2.plot(x, result["rm_score"], color="tab:orange", label="reward model score (the only reward)")
    ax.set_xlabel("step")
    ax.set_ylabel("rule accuracy")
    ax2.set_ylabel("reward model score")
    fig.legend(loc="lower right", fontsize=8)
    ax.set_title("default job, rewarded by a tiny reward model only (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap, "reward_model_sum_cpu.json")  # and the .png beside it
    ap.add_argument("--rm-steps", type=int, default=RM_STEPS)
    add_work_args(ap, "reward_model_sum")  # rm/ and run/
    ap.add_argument("--rm", default=None, help="a reward model trained before (a kept rm/ folder, copied out of "
                                               "--work first): the job runs on it instead of training one")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for mgrpo-train (after --)")
    args = ap.parse_args(argv)
    args.out = output_path(args, "reward_model_sum_cpu.json")
    work = fresh_work(args)
    print(f"reward model and run folder: {work} (kept)", flush=True)
    if args.rm:
        shutil.copytree(args.rm, os.path.join(work, "rm"))
        rm = {"rm_from": os.path.abspath(args.rm)}
        print(f"reward model: {args.rm} (trained before)", flush=True)
    else:
        rm = train_reward_model(os.path.join(work, "rm"), steps=args.rm_steps)
        print(f"reward model: {rm['rm_steps']} steps in {rm['rm_train_s']:.0f} s, held-out accuracy "
              f"{rm['rm_heldout_accuracy']:.3f}, right answer ranked first for "
              f"{rm['rm_right_answer_ranked_first']:.0%} of the prompts", flush=True)
    t0 = time.time()
    steps = run_job(os.path.join(work, "rm"), os.path.join(work, "run"), args.overrides)
    result = {"command": "python -m benchmarks.jobs.reward_model_sum " + " ".join(args.overrides), **rm,
              "job_wall_s": time.time() - t0, **summarise(steps)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(f"rule accuracy first 10 {result['rule_accuracy_first10']:.3f}, last 10 {result['rule_accuracy_last10']:.3f}; "
          f"reward model score first 10 {result['rm_score_first10']:.2f}, last 10 {result['rm_score_last10']:.2f}; "
          f"{result['steps']} steps, median {result['median_step_s']:.2f} s; wrote {args.out}")
    print(f"scoring (median per step): reward {result['median_reward_s']:.3f} s, of which the reference forward hid "
          f"{result['median_reward_hidden_s']:.3f} s (reward_wait {result['median_reward_wait_s']:.3f} s, ref "
          f"{result['median_ref_s']:.3f} s); the reward model {result['rm_samples_per_s_median']:.0f} samples/s")


if __name__ == "__main__":
    main()
