"""mgrpo-reward: score responses offline with the same judges the trainer uses.

    mgrpo-reward --in responses.jsonl --out scored.jsonl [--num-workers 2] [--timeout 10]
                 [--custom data_source=module:function ...] [--gsm8k-method strict|flexible]

Each input line holds `data_source`, `response`, the ground truth (`ground_truth`, or
`reward_model.ground_truth` as in an RL record) and optionally `extra_info`; each output line is the input
plus `score` (and `reward_status` when the call failed or timed out). All lines are checked before anything
is scored; errors name file:line:field (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from mgrpo.config.schema import Gsm8kJudgeConfig, RewardConfig
from mgrpo.data.records import RecordError, iter_raw
from mgrpo.rewards import Rules, ScoreRequest, check_data_sources

EXAMPLE = """\
an input line (JSONL, one response per line):
  {"data_source": "openai/gsm8k", "response": "3 + 4 = 7 ... #### 7", "ground_truth": "7"}
  (or an RL record with a response: {"data_source": ..., "prompt": ..., "response": "...",
   "reward_model": {"ground_truth": "7"}})
the same line in --out:
  {"data_source": "openai/gsm8k", "response": "3 + 4 = 7 ... #### 7", "ground_truth": "7", "score": 1.0}
judges by data_source: openai/gsm8k (veRL's strict '#### N' judge by default), math sources (math-verify),
mgrpo/sum, or --custom data_source=module:function"""


def read_requests(path: str) -> list[tuple[dict, ScoreRequest]]:
    out = []
    for n, raw in iter_raw(path):
        where = f"{path}:{n}"
        if not isinstance(raw, dict):
            raise RecordError(f"{where}: record must be an object, got {type(raw).__name__}")
        for key in ("data_source", "response"):
            if raw.get(key) is None:
                raise RecordError(f"{where}: field '{key}' missing")
            if not isinstance(raw[key], str):
                raise RecordError(f"{where}: field '{key}' must be a string, got {type(raw[key]).__name__}")
        rm = raw.get("reward_model")
        field, gt = ("ground_truth", raw["ground_truth"]) if raw.get("ground_truth") is not None else \
            ("reward_model.ground_truth", rm.get("ground_truth") if isinstance(rm, dict) else None)
        if gt is None:
            raise RecordError(f"{where}: field 'ground_truth' (or 'reward_model.ground_truth') missing")
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
            raise RecordError(f"{where}: field '{field}' must be a string or a number, got {type(gt).__name__}")
        extra = raw.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise RecordError(f"{where}: field 'extra_info' must be an object")
        out.append((raw, ScoreRequest(raw["data_source"], raw["response"], str(gt), extra)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mgrpo-reward", description=__doc__.split("\n\n")[0], epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="inp", required=True, help="JSONL (or Parquet) of responses")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--num-workers", type=int, default=RewardConfig.num_workers)
    p.add_argument("--timeout", type=float, default=RewardConfig.timeout_s, help="seconds per call")
    p.add_argument("--custom", action="append", default=[], metavar="SOURCE=MODULE:FUNCTION",
                   help="a user reward function for a data_source (repeatable)")
    p.add_argument("--gsm8k-method", choices=("strict", "flexible"), default="strict",
                   help="openai/gsm8k: the answer after '#### ' (strict, veRL's default) or the last number")
    p.add_argument("--gsm8k-format-score", type=float, default=0.0,
                   help="openai/gsm8k: score of a found but wrong answer (veRL's format_score)")
    args = p.parse_args(argv)
    try:
        custom = {}
        for item in args.custom:
            src, sep, spec = item.partition("=")
            if not sep:
                raise ValueError(f"--custom {item!r} must look like data_source=module:function")
            custom[src] = spec
        cfg = RewardConfig(custom_functions=custom, timeout_s=args.timeout, num_workers=args.num_workers,
                           gsm8k=Gsm8kJudgeConfig(method=args.gsm8k_method, format_score=args.gsm8k_format_score))
        rows = read_requests(args.inp)
        check_data_sources({req.data_source for _, req in rows}, cfg)
    except (RecordError, ValueError) as e:
        print(f"mgrpo-reward: error: {e}", file=sys.stderr)
        return 2

    try:  # fail before scoring when the output cannot be written
        out = open(args.out, "w", encoding="utf-8")
    except OSError as e:
        print(f"mgrpo-reward: error: --out {args.out}: cannot write ({e.strerror})", file=sys.stderr)
        return 2
    with Rules(cfg) as judger:
        result = judger.score([req for _, req in rows])
    with out:
        for (raw, _), score, status in zip(rows, result.scores, result.status):
            rec = {**raw, "score": score}
            if status != "ok":
                rec["reward_status"] = status
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    scored = [s for s in result.scores if s is not None]  # a failed call has score null, not 0
    mean = sum(scored) / max(len(scored), 1)
    print(f"scored {len(rows)} responses -> {args.out}: mean score {mean:.4f} (of {len(scored)} scored), "
          f"failed {result.failed}, timeout {result.timeout}")
    for err in result.errors:
        print(f"  e.g. {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
