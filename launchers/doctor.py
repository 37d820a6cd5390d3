"""mgrpo-doctor: where the rollout engine's and the trainer's log-probs of the same tokens part.

    mgrpo-doctor run outputs/mgrpo/sum-tiny                 # a run's mismatch: over steps, worst sequences, where
    mgrpo-doctor layers --engine outputs/mgrpo/sum-tiny/hf --trajectory outputs/mgrpo/sum-tiny/trajectories.jsonl \\
        --line 1234                                          # one sequence, layer by layer: the first place they part
    mgrpo-doctor layers --engine /ckpt/Qwen3-8B --engine-dtype bfloat16 --tokens 151644,872,198 --prompt-len 2
    mgrpo-doctor layers ... --engine-support sampled --top-k 5 --top-p 0.9  # engine log-probs over top-k/top-p

`run` needs trajectories with token log-probs (trainer.log_token_logprobs, on by default for small steps).
`layers` runs on CPU: transformers for the engine's side, megatron-core on one gloo rank for the trainer's.
Bad input (a missing folder, no token log-probs, shapes that do not match) is one message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from mgrpo.config import InputError
from mgrpo.doctor import SUPPORTS


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mgrpo-doctor", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="a run folder's engine/trainer log-prob differences")
    run.add_argument("run_dir")
    run.add_argument("--json", help="also write the report as JSON here")
    lay = sub.add_parser("layers", help="one sequence through both models, layer by layer")
    lay.add_argument("--engine", required=True, help="HF directory the engine loads (a run's hf/ or init_hf/)")
    lay.add_argument("--trainer", help="HF directory, a run's checkpoints/step_N, or an mgrpo-convert checkpoint "
                                       "(default: --engine)")
    lay.add_argument("--trajectory", help="trajectories.jsonl with token log-probs")
    lay.add_argument("--line", type=int, help="1-based line of --trajectory")
    lay.add_argument("--tokens", help="token ids, comma-separated (prompt then response)")
    lay.add_argument("--prompt-len", type=int, help="how many of --tokens are the prompt")
    lay.add_argument("--engine-dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    lay.add_argument("--trainer-dtype", default="float32", help="float32 (default) | bfloat16")
    lay.add_argument("--temperature", type=float, default=1.0, help="the rollout temperature (default 1)")
    lay.add_argument("--engine-support", default="full",
                     help="what the engine's log-probs are normalised over (" + " | ".join(SUPPORTS) + "): full "
                          "(the whole tempered distribution, the default) or sampled (each token's top-k / top-p "
                          "support)")
    lay.add_argument("--trainer-support", default="full",
                     help="the same for the trainer (algorithm.logprob_support)")
    lay.add_argument("--top-k", type=int, default=-1, help="the rollout's top_k (for a sampled support)")
    lay.add_argument("--top-p", type=float, default=1.0, help="the rollout's top_p (for a sampled support)")
    lay.add_argument("--tolerance", type=float, help="relative tolerance per site (default: by the dtypes)")
    lay.add_argument("--json", help="also write the comparison as JSON here")
    return ap


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    try:
        if args.command == "run":
            from mgrpo.doctor.run_report import analyse, render

            report = analyse(args.run_dir)
            text = render(report)
        else:
            from mgrpo.doctor.engine_side import Support
            from mgrpo.doctor.layers import layers, render

            report = layers(args.engine, trainer=args.trainer, tokens=args.tokens, prompt_len=args.prompt_len,
                            trajectory=args.trajectory, line=args.line, engine_dtype=args.engine_dtype,
                            trainer_dtype=args.trainer_dtype, temperature=args.temperature,
                            engine_support=Support(args.engine_support, args.top_k, args.top_p),
                            trainer_support=Support(args.trainer_support, args.top_k, args.top_p),
                            tolerance=args.tolerance)
            text = render(report)
    except InputError as err:
        print(f"mgrpo-doctor: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `mgrpo-doctor run ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.json:
        _write_json(args.json, report)


if __name__ == "__main__":
    main()
