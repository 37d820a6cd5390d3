"""A generative judge as the only reward, CPU-sized: the example of a judge run that fits a laptop.

    python -m benchmarks.jobs.judge_tiny_cpu                          # 5 steps of the default job, judged
    python -m benchmarks.jobs.judge_tiny_cpu --top-logprobs 1         # the judge's Y/N unseen: refused in one line
    python -m benchmarks.jobs.judge_tiny_cpu -- trainer.total_training_steps=20   # more mgrpo-train overrides

1. Makes the judge in --work (default outputs/judge_tiny_cpu/): a tiny Qwen3-shaped chat model on the printable
   tokenizer (its chat template; 107 tokens, so judge.top_logprobs=107 sees every token), random weights, seed 0,
   and its template (`Q:{{ question }} A:{{ response }} Right? Y or N`).
2. Runs the default job (`mgrpo-train`, the sum task) with that judge as its only reward: its own CPU server,
   hosted as a reward engine, asked for one token with the yes/no parser (P(Y) / (P(Y) + P(N)) from the first
   token's top log-probs), the rule's score computed beside it at weight 0. The judge is untrained: this shows the
   path and its metrics (reward/judge/mean, reward/judge/unparsed, timing_s/reward), not learning.
3. Writes judge_tiny_cpu.json (outputs/benchmarks/, or benchmarks/results/ with --update-results). The judge and
   the run folder stay in --work. A run refused by the judges (reward.failed.max_rate) ends with mgrpo-train's one
   line naming the keys to change, and the same exit status (2).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks import REPO, add_output_args, add_work_args, fresh_work, output_path

TEMPLATE = "Q:{{ question }}\nA:{{ response }}\nRight? Y or N"


def make_judge(folder: str) -> tuple[str, str]:
    """The tiny chat judge and its template file in `folder`; their paths."""
    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.printable import printable_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint

    judge, template = os.path.join(folder, "judge"), os.path.join(folder, "judge.j2")
    init_hf_checkpoint(judge, ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512,
                                          init_std=0.1), seed=0, tokenizer=printable_tokenizer())
    with open(template, "w") as f:
        f.write(TEMPLATE)
    return judge, template


def judge_overrides(judge: str, template: str, top_logprobs: int) -> list[str]:
    """The mgrpo-train overrides that make the judge the only reward of the sum task."""
    return [f"reward.models={{judge: {{kind: generative, hf_path: '{judge}', timeout_s: 60, judge: "
            f"{{template_file: '{template}', parser: yes_no, yes: Y, no: N, top_logprobs: {top_logprobs}}}}}}}",
            "reward.compose={mgrpo/sum: {judge: 1.0}}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap, "judge_tiny_cpu.json")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top-logprobs", type=int, default=107, help="judge.top_logprobs (107: the whole vocabulary)")
    add_work_args(ap, "judge_tiny_cpu")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for mgrpo-train (after --)")
    args = ap.parse_args(argv)
    args.out = output_path(args, "judge_tiny_cpu.json")
    work = fresh_work(args)
    judge, template = make_judge(work)
    run_dir = os.path.join(work, "run")
    cmd = [sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}",
           f"trainer.total_training_steps={args.steps}", *judge_overrides(judge, template, args.top_logprobs),
           *args.overrides]
    print(f"judge and run folder: {work} (kept)\n$ mgrpo-train {shlex.join(cmd[3:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = proc.stdout.splitlines()
    print("\n".join(line for line in lines if line.startswith("step ")), flush=True)
    if proc.returncode != 0:  # exit 2: mgrpo-train's own last line says what to change; else its last lines
        print("\n".join(lines[-1 if proc.returncode == 2 else -40:]), file=sys.stderr)
        sys.exit(proc.returncode)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "reward/judge/mean" in m]
    keys = ("reward/judge/mean", "reward/rule/mean", "reward/judge/unparsed", "reward/failed", "timing_s/reward",
            "timing_s/reward_wait", "reward/judge/samples_per_s")
    result = {"command": "python -m benchmarks.jobs.judge_tiny_cpu " + " ".join(argv or sys.argv[1:]),
              "wall_s": time.time() - t0, "steps": len(steps),
              "per_step": [{k: m.get(k) for k in ("step", *keys)} for m in steps]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    last = steps[-1]
    print(f"{len(steps)} steps judged by the tiny judge in {result['wall_s']:.0f} s; last step: judge mean "
          f"{last['reward/judge/mean']:.3f} (rule, weight 0: {last['reward/rule/mean']:.3f}), unparsed "
          f"{last['reward/judge/unparsed']:.0f}, failed {last['reward/failed']:.0f}, scoring "
          f"{last['timing_s/reward']:.3f} s ({last['reward/judge/samples_per_s']:.0f} samples/s); wrote {args.out}")


if __name__ == "__main__":
    main()
