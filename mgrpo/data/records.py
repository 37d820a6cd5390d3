"""RL records on disk (JSONL or Parquet), read strictly.

One record per line / row, in the format veRL users already have:
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}], "ability": "math",
     "reward_model": {"ground_truth": "72", "style": "rule"}, "extra_info": {...}}
`prompt` may also be a plain string (raw-text tasks such as the synthetic ones).

Every problem raises `RecordError` naming file, line (1-based; the row number for Parquet) and the
field, e.g. `train.jsonl:17: field 'reward_model.ground_truth' missing`. Nothing is skipped or
repaired silently: a dataset either loads completely or not at all. The only coercion is a numeric
ground truth (Parquet files often store 72 rather than "72"), which becomes its string form.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from mgrpo.config import InputError

Prompt = Union[str, list[dict]]


class RecordError(InputError):
    """A malformed RL record; the message starts with 'file:line:'."""


@dataclass
class RLRecord:
    data_source: str
    prompt: Prompt
    ground_truth: str
    ability: Optional[str] = None
    extra_info: dict = field(default_factory=dict)
    where: str = ""
    """'file:line' the record came from, for later error messages."""


def _fmt(path: str) -> str:
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    raise RecordError(f"{path}: unknown format (expected .jsonl, .json or .parquet)")


def iter_raw(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each record of a JSONL or Parquet file."""
    if not os.path.exists(path):
        raise RecordError(f"{path}: file not found")
    if _fmt(path) == "parquet":
        import pyarrow.parquet as pq

        # ParquetFile, not read_table: read_table goes through pyarrow.dataset, which imports pandas (~40 MiB of
        # the driver for nothing); a row group at a time, so Arrow never holds the whole file beside the rows
        try:
            rows = [row for batch in pq.ParquetFile(path).iter_batches(batch_size=1024) for row in batch.to_pylist()]
        except Exception as e:  # pyarrow's own errors do not name the file
            raise RecordError(f"{path}: cannot read Parquet ({e})") from e
        yield from enumerate(rows, start=1)
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None


def _prompt(value: Any, where: str, key: str) -> Prompt:
    if isinstance(value, str):
        if not value:
            raise RecordError(f"{where}: field '{key}' is empty")
        return value
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: field '{key}' must be a string or a non-empty list of chat messages, "
                          f"got {type(value).__name__}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise RecordError(f"{where}: field '{key}[{i}]' must be a message object, got {type(msg).__name__}")
        for part in ("role", "content"):
            if part not in msg or msg[part] is None:
                raise RecordError(f"{where}: field '{key}[{i}].{part}' missing")
            if not isinstance(msg[part], str):
                raise RecordError(f"{where}: field '{key}[{i}].{part}' must be a string, "
                                  f"got {type(msg[part]).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def parse_record(raw: Any, where: str, prompt_key: str = "prompt") -> RLRecord:
    """Validate one raw record (already parsed from JSON/Parquet); `where` is 'file:line'."""
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: record must be an object, got {type(raw).__name__}")
    src = raw.get("data_source")
    if src is None:
        raise RecordError(f"{where}: field 'data_source' missing")
    if not isinstance(src, str) or not src:
        raise RecordError(f"{where}: field 'data_source' must be a non-empty string, got {src!r}")
    if raw.get(prompt_key) is None:
        raise RecordError(f"{where}: field '{prompt_key}' missing")
    prompt = _prompt(raw[prompt_key], where, prompt_key)
    rm = raw.get("reward_model")
    if rm is None:
        raise RecordError(f"{where}: field 'reward_model' missing")
    if not isinstance(rm, dict):
        raise RecordError(f"{where}: field 'reward_model' must be an object, got {type(rm).__name__}")
    gt = rm.get("ground_truth")
    if gt is None:
        raise RecordError(f"{where}: field 'reward_model.ground_truth' missing")
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
        raise RecordError(f"{where}: field 'reward_model.ground_truth' must be a string or a number, "
                          f"got {type(gt).__name__}")
    ability = raw.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise RecordError(f"{where}: field 'ability' must be a string, got {type(ability).__name__}")
    extra = raw.get("extra_info")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        raise RecordError(f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    return RLRecord(data_source=src, prompt=prompt, ground_truth=str(gt), ability=ability, extra_info=dict(extra),
                    where=where)


def read_records(path: str, prompt_key: str = "prompt") -> list[RLRecord]:
    """All records of one file, validated; raises RecordError on the first bad one."""
    records = [parse_record(raw, f"{path}:{n}", prompt_key) for n, raw in iter_raw(path)]
    if not records:
        raise RecordError(f"{path}: no records")
    return records


def write_records(path: str, records: list[dict]) -> None:
    """Write raw record dicts as JSONL or Parquet (by extension)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if _fmt(path) == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
        return
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
