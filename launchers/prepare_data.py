"""mgrpo-prepare: convert raw datasets into RL records (JSONL or Parquet).

    mgrpo-prepare gsm8k --input-dir ../shared/data/gsm8k --out-dir data/gsm8k [--format jsonl|parquet]

The output is ready for data.train_files / data.val_files (train.<fmt>, test.<fmt>).
"""

from __future__ import annotations

import argparse
import sys

from mgrpo.data.records import RecordError


def _gsm8k(args: argparse.Namespace) -> int:
    from mgrpo.data.gsm8k import convert_gsm8k

    for split, (path, count) in convert_gsm8k(args.input_dir, args.out_dir, args.format).items():
        print(f"gsm8k {split}: {count} records -> {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgrpo-prepare", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help="raw GSM8K (question/answer with '#### N') -> RL records")
    g.add_argument("--input-dir", required=True,
                   help="folder with train.jsonl/test.jsonl (or .parquet, or HF's main/<split>-*.parquet)")
    g.add_argument("--out-dir", required=True)
    g.add_argument("--format", choices=("jsonl", "parquet"), default="parquet")
    g.set_defaults(run=_gsm8k)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (RecordError, FileNotFoundError) as e:
        print(f"mgrpo-prepare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder cannot be written
        print(f"mgrpo-prepare: error: {e.filename or args.out_dir}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
