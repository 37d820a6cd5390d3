"""Prompts for rollouts: records -> chat template -> token ids -> batches, with a resumable position.

The training stream is the concatenation of per-epoch permutations (seeded by data.seed and the
epoch number), cut into batches of data.train_batch_size prompts. A batch may straddle two epochs:
that keeps every batch full even when the dataset is smaller than a batch (the synthetic task has
25 prompts, the default batch 32), and it means a prompt can appear twice in one batch, so group
responses by their position in the batch, never by `PromptItem.index`.

A prompt holding a character its tokenizer cannot represent (one that would encode as <unk>) is an error
naming file:line, field and character: training on <unk> would silently change the user's data.
Prompts longer than data.max_prompt_length tokens (after templating) are dropped once, at load,
and counted in `num_filtered` (per data source in `filtered_by_source`). The resumable state is
(epoch, position in the epoch's permutation): a dataset restored from `state_dict()` yields exactly
the batches the original would have yielded next. Left out: streaming from datasets too large for
memory, and re-sampling weights between files (files are mixed by one shuffle over all of them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mgrpo.config import ConfigError, seeds
from mgrpo.config.schema import DataConfig
from mgrpo.data.records import RecordError, RLRecord, parse_record, read_records
from mgrpo.data.synthetic import synthetic_records


TOKENIZE_BATCH = 256
"""Prompts tokenized per call at load."""


@dataclass
class PromptItem:
    index: int
    """Position of the prompt in this dataset (after length filtering); stable across epochs."""
    prompt_ids: list[int]
    prompt_text: str
    """The prompt after templating, as the model sees it."""
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    ability: Optional[str] = None
    where: str = ""
    """file:line of the record (or the synthetic task's name and index), for messages."""
    messages: list = field(default_factory=list)
    """The prompt as chat messages (empty for a raw-text prompt); multi-turn rollouts continue them."""
    tools: Optional[list] = None
    """Multi-turn: the tool schemas the template rendered into the prompt (`tools_for`), else None."""
    prompt: Any = None
    """The record's prompt as written (a string or chat messages): what a reward model's own chat template
    formats, next to the response."""


class PromptDataset:
    """Templated, tokenized prompts of one split; see the module docstring.

    files: RL record files (JSONL/Parquet), mixed. None = data_cfg.train_files for split 'train',
    data_cfg.val_files otherwise. With no files and no data.train_files at all, the built-in
    synthetic task (data.synthetic_task) is the dataset, for train and val alike; with train files
    but no val files, the val dataset is empty.
    """

    def __init__(self, data_cfg: DataConfig, tokenizer, files: Optional[list[str]] = None, split: str = "train",
                 tools_for: Optional[Callable[[dict, str], list]] = None):
        """`tools_for(extra_info, where)`: the tool schemas a record's prompt is rendered with (multi-turn
        rollouts, `mgrpo.agent.tools.ToolSet`); None: no tools."""
        self.cfg, self.tokenizer, self.split = data_cfg, tokenizer, split
        self.tools_for = tools_for
        if files is None:
            files = data_cfg.train_files if split == "train" else data_cfg.val_files
        self.files = list(files)
        if self.files:
            records = [r for f in self.files for r in read_records(f, data_cfg.prompt_key)]
        elif not data_cfg.train_files:
            task = f"<synthetic:{data_cfg.synthetic_task}>"
            records = [parse_record(r, f"{task}:{i + 1}") for i, r in enumerate(synthetic_records(data_cfg))]
        else:
            records = []
        self.items: list[PromptItem] = []
        self.num_filtered = 0
        self.filtered_by_source: dict[str, int] = {}
        self._load(records)
        self.seed, self.shuffle = seeds.stream_seed(data_cfg.seed), data_cfg.shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    # --- loading ----------------------------------------------------------------------------------
    def _messages(self, rec: RLRecord) -> list:
        return [{"role": "user", "content": rec.prompt}] if isinstance(rec.prompt, str) else list(rec.prompt)

    def _tools(self, rec: RLRecord) -> Optional[list]:
        return self.tools_for(rec.extra_info, rec.where) if self.tools_for is not None else None

    def _render(self, rec: RLRecord) -> str:
        tok, use_template = self.tokenizer, self.cfg.apply_chat_template
        has_template = bool(getattr(tok, "chat_template", None))
        if isinstance(rec.prompt, str):
            if not (use_template and has_template):
                if self.tools_for is not None:
                    raise RecordError(f"{rec.where}: multi-turn rollouts need the chat template (tools are rendered "
                                      "by it): set data.apply_chat_template=True and a tokenizer that has one")
                return rec.prompt  # raw-text prompt (the synthetic tokenizer has no template)
            messages = [{"role": "user", "content": rec.prompt}]
        else:
            if not use_template:
                raise RecordError(f"{rec.where}: field '{self.cfg.prompt_key}' is a list of chat messages but "
                                  "data.apply_chat_template=False (give a string prompt or turn it on)")
            if not has_template:
                raise RecordError(f"{rec.where}: field '{self.cfg.prompt_key}' is a list of chat messages but the "
                                  "tokenizer has no chat template (model.tokenizer='synthetic' takes string prompts)")
            messages = rec.prompt
        return tok.apply_chat_template(messages, tools=self._tools(rec), tokenize=False, add_generation_prompt=True,
                                       enable_thinking=self.cfg.enable_thinking)

    def _load(self, records: list[RLRecord]) -> None:
        texts = [self._render(r) for r in records]
        # The template already holds any special tokens; do not let the tokenizer add more. TOKENIZE_BATCH texts
        # per call: one call over all of GSM8K's 7,473 left the driver ~70 MiB larger (the fast tokenizer's
        # encodings of every text at once, returned to the heap but not to the system).
        ids = [x for i in range(0, len(texts), TOKENIZE_BATCH)
               for x in self.tokenizer(texts[i:i + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]]
        unk = self.tokenizer.unk_token_id
        longest = None  # (length, record) of the longest prompt over the limit
        for rec, text, tok_ids in zip(records, texts, ids):
            if unk is not None and unk in tok_ids:
                raise RecordError(self._unrepresentable(rec))
            if len(tok_ids) > self.cfg.max_prompt_length:
                if longest is None or len(tok_ids) > longest[0]:
                    longest = (len(tok_ids), rec)
                self.num_filtered += 1
                self.filtered_by_source[rec.data_source] = self.filtered_by_source.get(rec.data_source, 0) + 1
                continue
            self.items.append(PromptItem(index=len(self.items), prompt_ids=list(tok_ids), prompt_text=text,
                                         data_source=rec.data_source, ground_truth=rec.ground_truth,
                                         extra_info=rec.extra_info, ability=rec.ability, where=rec.where,
                                         messages=self._messages(rec), tools=self._tools(rec), prompt=rec.prompt))
        if records and not self.items:
            shortest = min(len(x) for x in ids)
            raise ConfigError(f"all {len(records)} prompts of {self.files or 'the synthetic task'} are longer than "
                              f"data.max_prompt_length={self.cfg.max_prompt_length} tokens: {shortest} to "
                              f"{longest[0]} tokens; the longest ({longest[1].where}) is "
                              f"{self._made_of(longest[1], longest[0])}")

    def _made_of(self, rec: RLRecord, length: int) -> str:
        """What a rendered prompt's tokens are: its messages' text, the tool schemas the chat template writes
        into the system prompt (multi-turn), and the template's own tokens."""
        count = lambda text: len(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        content = sum(count(m["content"]) for m in self._messages(rec) if isinstance(m.get("content"), str))
        tools = 0
        if self._tools(rec):
            bare = self.tokenizer.apply_chat_template(self._messages(rec), tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=self.cfg.enable_thinking)
            tools = length - count(bare)
        parts = [f"its messages' text {content}"] + ([f"the tool schemas in the system prompt {tools}"] if tools else [])
        return f"{length} tokens: {', '.join(parts)}, the chat template {length - content - tools}"

    def _unrepresentable(self, rec: RLRecord) -> str:
        """Which field of `rec` holds the first character its tokenizer maps to <unk>, and which character."""
        tok, key = self.tokenizer, self.cfg.prompt_key
        fields = [(key, rec.prompt)] if isinstance(rec.prompt, str) else \
            [(f"{key}[{i}].content", m["content"]) for i, m in enumerate(rec.prompt)]
        fix = ("replace it in the data, or use a tokenizer that covers it (model.tokenizer=qwen3 or a tokenizer "
               "directory; model.tokenizer=printable covers printable ASCII, tab and newline)")
        for name, value in fields:
            enc = tok(value, add_special_tokens=False, return_offsets_mapping=True)
            bad = [value[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if t == tok.unk_token_id]
            if bad:
                at = next(a for t, (a, _) in zip(enc["input_ids"], enc["offset_mapping"]) if t == tok.unk_token_id)
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                return (f"{rec.where}: field '{name}': character {bad[0]!r} (U+{ord(bad[0][0]):04X}) at position "
                        f"{at + 1} is not in the tokenizer's vocabulary{more}: it would become {tok.unk_token}; {fix}")
        return (f"{rec.where}: the chat template's rendering of field '{key}' holds a character that is not in the "
                f"tokenizer's vocabulary (it would become {tok.unk_token}); {fix}")

    # --- access ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def data_sources(self) -> set[str]:
        return {it.data_source for it in self.items}

    def samples(self) -> dict[str, tuple[str, str, dict]]:
        """data_source -> (where, ground_truth, extra_info) of its first record: what a reward function is
        tried on at start."""
        out: dict[str, tuple[str, str, dict]] = {}
        for it in self.items:
            out.setdefault(it.data_source, (it.where, it.ground_truth, it.extra_info))
        return out

    def all_items(self, limit: Optional[int] = None) -> list[PromptItem]:
        """Items in file order (validation): the first `limit` of them, or all."""
        return self.items if limit is None else self.items[:limit]

    def batches_per_epoch(self) -> int:
        """Full batches in one pass (at least 1, since batches straddle epochs)."""
        return max(1, len(self.items) // self.cfg.train_batch_size)

    # --- the training stream -----------------------------------------------------------------------
    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            # Python's Mersenne Twister with an int seed and random.shuffle are stable across versions,
            # so a resumed run (even on a newer Python/numpy/torch) regenerates the same order.
            random.Random(seeds.data_seed(self.seed, epoch)).shuffle(order)
        return order

    def next_batch(self, batch_size: Optional[int] = None) -> list[PromptItem]:
        """The next `batch_size` (default data.train_batch_size) prompts of the stream."""
        n = batch_size or self.cfg.train_batch_size
        if not self.items:
            raise ValueError(f"the {self.split} dataset is empty: nothing to sample")
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self.items[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_items": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_items"] != len(self.items):
            raise ValueError(f"cannot resume the {self.split} data position: it was saved for {state['num_items']} "
                             f"prompts but the dataset now has {len(self.items)} (data files or "
                             "max_prompt_length changed?)")
        # The saved seed and shuffle win: resuming means continuing the same stream.
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
