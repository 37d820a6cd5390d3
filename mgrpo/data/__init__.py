"""RL data: records on disk, tokenizers, templated prompt batches, micro-batch packing, converters.

Imports only mgrpo.config and libraries (tokenizers, transformers, pyarrow) - never torch
distributed, Ray or the trainer.

  records.py     RL records on disk (JSONL or Parquet), read strictly
  dataset.py     prompts: records -> chat template -> token ids -> batches, resumable
  tokenizer.py   which tokenizer a run uses (synthetic, printable, qwen3, a folder)
  synthetic.py   the built-in synthetic tasks and their compact tokenizer
  printable.py   a character-level tokenizer for a user's own text task on the tiny model
  gsm8k.py       raw GSM8K -> RL records, as veRL's preprocessing
  packing.py     micro-batches under a token budget (padded or packed)
"""

from mgrpo.data.dataset import PromptDataset, PromptItem
from mgrpo.data.packing import over_budget, pack_micro_batches, padded_tokens
from mgrpo.data.records import RecordError, RLRecord, parse_record, read_records, write_records
from mgrpo.data.synthetic import SYNTHETIC_TASKS, synthetic_records, synthetic_tokenizer
from mgrpo.data.printable import printable_tokenizer
from mgrpo.data.tokenizer import check_vocab, load_tokenizer, qwen3_tokenizer_dir

__all__ = [
    "PromptDataset", "PromptItem", "RLRecord", "RecordError", "SYNTHETIC_TASKS", "check_vocab", "load_tokenizer",
    "over_budget", "pack_micro_batches", "padded_tokens", "parse_record", "printable_tokenizer", "qwen3_tokenizer_dir",
    "read_records", "synthetic_records", "synthetic_tokenizer", "write_records",
]
