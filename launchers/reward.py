"""mgrpo-reward: score responses offline with the same judges the trainer uses.

    mgrpo-reward --in responses.jsonl --out scored.jsonl [--num-workers 2] [--timeout 10]
                 [--custom data_source=module:function ...]

Each input line holds `data_source`, `response`, `ground_truth` and optionally `extra_info`; each
output line is the input plus `score` (and `reward_status` when the call failed or timed out).
All lines are checked before anything is scored; errors name file:line:field.
"""

from __future__ import annotations

import argparse
import json
import sys

from mgrpo.config.schema import RewardConfig
from mgrpo.data.records import RecordError, iter_raw
from mgrpo.rewards import Judger, ScoreRequest, check_data_sources


def read_requests(path: str) -> list[tuple[dict, ScoreRequest]]:
    out = []
    for n, raw in iter_raw(path):
        where = f"{path}:{n}"
        if not isinstance(raw, dict):
            raise RecordError(f"{where}: record must be an object, got {type(raw).__name__}")
        for key in ("data_source", "response", "ground_truth"):
            if raw.get(key) is None:
                raise RecordError(f"{where}: field '{key}' missing")
        if not isinstance(raw["data_source"], str) or not isinstance(raw["response"], str):
            raise RecordError(f"{where}: fields 'data_source' and 'response' must be strings")
        gt = raw["ground_truth"]
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
            raise RecordError(f"{where}: field 'ground_truth' must be a string or a number")
        extra = raw.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise RecordError(f"{where}: field 'extra_info' must be an object")
        out.append((raw, ScoreRequest(raw["data_source"], raw["response"], str(gt), extra)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mgrpo-reward", description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="inp", required=True, help="JSONL (or Parquet) of responses")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--num-workers", type=int, default=RewardConfig.num_workers)
    p.add_argument("--timeout", type=float, default=RewardConfig.timeout_s, help="seconds per call")
    p.add_argument("--custom", action="append", default=[], metavar="SOURCE=MODULE:FUNCTION",
                   help="a user reward function for a data_source (repeatable)")
    args = p.parse_args(argv)
    try:
        custom = {}
        for item in args.custom:
            src, sep, spec = item.partition("=")
            if not sep:
                raise ValueError(f"--custom {item!r} must look like data_source=module:function")
            custom[src] = spec
        cfg = RewardConfig(custom_functions=custom, timeout_s=args.timeout, num_workers=args.num_workers)
        rows = read_requests(args.inp)
        check_data_sources({req.data_source for _, req in rows}, cfg)
    except (RecordError, ValueError) as e:
        print(f"mgrpo-reward: error: {e}", file=sys.stderr)
        return 2

    with Judger(cfg) as judger:
        result = judger.score([req for _, req in rows])
    with open(args.out, "w", encoding="utf-8") as f:
        for (raw, _), score, status in zip(rows, result.scores, result.status):
            rec = {**raw, "score": score}
            if status != "ok":
                rec["reward_status"] = status
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    mean = sum(result.scores) / max(len(result.scores), 1)
    print(f"scored {len(rows)} responses -> {args.out}: mean score {mean:.4f}, "
          f"failed {result.failed}, timeout {result.timeout}")
    for err in result.errors:
        print(f"  e.g. {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
