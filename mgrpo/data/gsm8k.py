"""Raw GSM8K (`question`, `answer` ending in `#### 72`) -> RL records, as veRL's gsm8k preprocessing.

The user message is the question followed by an instruction to reason step by step and put the
final answer after "####"; the ground truth is the number after "####" with thousands separators
removed; extra_info keeps split, index, the raw question and the reference solution (so the judge
can be checked against it). Used by `mgrpo-prepare gsm8k`.
"""

from __future__ import annotations

import glob
import os
import re

from mgrpo.data.records import RecordError, iter_raw, write_records

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")


def extract_final_answer(answer: str) -> str | None:
    """The number after the final '####' of a reference solution, commas removed; None if absent."""
    m = _FINAL.search(answer.strip())
    return m.group(1).replace(",", "") if m else None


def convert_record(raw: object, split: str, index: int, where: str) -> dict:
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: record must be an object, got {type(raw).__name__}")
    for key in ("question", "answer"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise RecordError(f"{where}: field '{key}' " + ("missing" if raw.get(key) is None else "must be a "
                              "non-empty string"))
    final = extract_final_answer(raw["answer"])
    if final is None:
        raise RecordError(f"{where}: field 'answer' does not end with '#### <number>'")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final},
        "extra_info": {"split": split, "index": index, "question": raw["question"], "answer": raw["answer"]},
    }


def convert_file(path: str, split: str) -> list[dict]:
    return [convert_record(raw, split, i, f"{path}:{n}") for i, (n, raw) in enumerate(iter_raw(path))]


def find_split_file(input_dir: str, split: str) -> str:
    """`<split>.jsonl` or `<split>.parquet`, or the Hugging Face layout `main/<split>-*.parquet`."""
    for pattern in (f"{split}.jsonl", f"{split}.parquet", f"main/{split}-*.parquet", f"{split}-*.parquet"):
        hits = sorted(glob.glob(os.path.join(input_dir, pattern)))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"no GSM8K {split} split in {input_dir} (looked for {split}.jsonl, {split}.parquet, "
                            f"main/{split}-*.parquet)")


def convert_gsm8k(input_dir: str, out_dir: str, fmt: str = "parquet") -> dict[str, tuple[str, int]]:
    """Convert both splits; returns {split: (output path, records written)}."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"format={fmt!r} must be 'jsonl' or 'parquet'")
    # Convert (and so validate) everything before writing anything: no half-written output.
    converted = {split: convert_file(find_split_file(input_dir, split), split) for split in SPLITS}
    out = {}
    for split, records in converted.items():
        path = os.path.join(out_dir, f"{split}.{fmt}")
        write_records(path, records)
        out[split] = (path, len(records))
    return out
