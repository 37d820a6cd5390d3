"""Records, tokenizers, the synthetic task, the prompt dataset (batches, filtering, resume) and packing."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from mgrpo.config import ConfigError, DataConfig, MGRPOConfig, ModelConfig
from mgrpo.preflight import preflight
from mgrpo.data import (
    SYNTHETIC_TASKS,
    PromptDataset,
    RecordError,
    load_tokenizer,
    over_budget,
    pack_micro_batches,
    read_records,
    synthetic_records,
    synthetic_tokenizer,
    write_records,
)


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer(ModelConfig(tokenizer="qwen3"))


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _rec(i, source="openai/gsm8k", prompt=None):
    return {"data_source": source, "prompt": prompt or [{"role": "user", "content": f"question {i}"}],
            "ability": "math", "reward_model": {"ground_truth": str(i), "style": "rule"}, "extra_info": {"index": i}}


# --- synthetic task and tokenizers ---------------------------------------------------------------

def test_synthetic_registry_is_what_config_validation_accepts():
    for name, task in SYNTHETIC_TASKS.items():
        preflight(MGRPOConfig(data=DataConfig(synthetic_task=name)), check_memory=False)
        assert {r["data_source"] for r in task.records(DataConfig())} == {task.data_source}
    message = f"data.synthetic_task='nope' is not one of {list(SYNTHETIC_TASKS)}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(MGRPOConfig(data=DataConfig(synthetic_task="nope")), check_memory=False)


def test_synthetic_tokenizer(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = synthetic_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) <= 16 and len(tok) <= ModelConfig().vocab_size
    ids = tok("3+4=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "3+4="
    seven_eos = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(seven_eos, skip_special_tokens=True) == "7"
    assert tok.decode(tok("1 0")["input_ids"]) == "10"   # whitespace dropped, no spaces on decode
    assert tok.pad_token_id != tok.eos_token_id
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert load_tokenizer(ModelConfig(tokenizer=str(tmp_path)))("9")["input_ids"] == tok("9")["input_ids"]


def test_load_tokenizer_errors():
    with pytest.raises(ValueError, match="model.tokenizer='/nope'"):
        load_tokenizer(ModelConfig(tokenizer="/nope"))


def test_qwen3_tokenizer(qwen3):
    assert qwen3.eos_token == "<|im_end|>" and len(qwen3) > 150_000


def test_sum_task_records():
    recs = synthetic_records(DataConfig())
    assert len(recs) == 25  # a, b in 0..4
    assert {r["data_source"] for r in recs} == {"mgrpo/sum"}
    by_prompt = {r["prompt"]: r["reward_model"]["ground_truth"] for r in recs}
    assert by_prompt["3+4="] == "7" and by_prompt["0+0="] == "0"
    assert len(synthetic_records(DataConfig(synthetic_max_operand=2))) == 9


# --- records -------------------------------------------------------------------------------------

def test_read_records_jsonl_and_parquet(tmp_path):
    rows = [_rec(1), {**_rec(2), "prompt": "plain string prompt"}, {**_rec(3), "reward_model": {"ground_truth": 72}}]
    path = str(tmp_path / "a.jsonl")
    write_records(path, rows)
    recs = read_records(path)
    assert [r.ground_truth for r in recs] == ["1", "2", "72"]   # numeric ground truth -> string
    assert recs[0].prompt == [{"role": "user", "content": "question 1"}]
    assert recs[1].prompt == "plain string prompt"
    assert recs[2].where == f"{path}:3" and recs[0].extra_info == {"index": 1}
    # Parquet columns are typed: a file of integer ground truths (common in the wild) reads as strings
    pq_path = str(tmp_path / "a.parquet")
    write_records(pq_path, [{**_rec(i), "reward_model": {"ground_truth": i}} for i in range(3)])
    recs = read_records(pq_path)
    assert [r.ground_truth for r in recs] == ["0", "1", "2"] and recs[2].where == f"{pq_path}:3"
    assert recs[1].prompt == [{"role": "user", "content": "question 1"}] and recs[1].extra_info == {"index": 1}


def test_parquet_of_several_batches_reads_every_row_in_order_and_a_broken_one_names_the_file(tmp_path):
    """Parquet is read a batch of 1,024 rows at a time (records.py): 2,600 rows in 3 row groups come back whole
    and in file order; a file that is not Parquet fails naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "big.parquet")
    rows = [{**_rec(i), "reward_model": {"ground_truth": str(i), "style": "rule"}} for i in range(2600)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    recs = read_records(path)
    assert [r.ground_truth for r in recs] == [str(i) for i in range(2600)] and recs[-1].where == f"{path}:2600"
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(RecordError, match=rf"{re.escape(str(bad))}: cannot read Parquet"):
        read_records(str(bad))


@pytest.mark.integration
def test_reading_parquet_imports_no_pandas(tmp_path):
    """pyarrow's read_table goes through pyarrow.dataset, which imports pandas: ~40 MiB of the driver."""
    import subprocess
    import sys

    path = str(tmp_path / "a.parquet")
    write_records(path, [_rec(i) for i in range(3)])
    code = f"import sys; from mgrpo.data.records import read_records; read_records({path!r}); print('pandas' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("bad, message", [
    ({k: v for k, v in _rec(0).items() if k != "reward_model"}, "field 'reward_model' missing"),
    ({**_rec(0), "reward_model": {"style": "rule"}}, "field 'reward_model.ground_truth' missing"),
    ({k: v for k, v in _rec(0).items() if k != "data_source"}, "field 'data_source' missing"),
    ({**_rec(0), "prompt": [{"role": "user"}]}, r"field 'prompt\[0\].content' missing"),
    ({**_rec(0), "prompt": []}, "field 'prompt' must be a string or a non-empty list"),
    ({**_rec(0), "extra_info": [1]}, "field 'extra_info' must be an object"),
    ({**_rec(0), "reward_model": {"ground_truth": [1, 2]}}, "field 'reward_model.ground_truth' must be a string or a number"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "record must be an object"),
])
def test_bad_records_name_file_line_field(tmp_path, bad, message):
    path = _jsonl(tmp_path / "train.jsonl", [_rec(i) for i in range(16)] + [bad])
    with pytest.raises(RecordError, match=rf"train.jsonl:17: {message}"):
        read_records(path)


def test_missing_file_and_wrong_extension(tmp_path):
    with pytest.raises(RecordError, match="file not found"):
        read_records(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(RecordError, match="unknown format"):
        read_records(str(tmp_path / "x.csv"))


# --- the prompt dataset --------------------------------------------------------------------------

def _ids(batch):
    return [it.index for it in batch]


def test_synthetic_dataset_batches_straddle_epochs():
    tok = synthetic_tokenizer()
    ds = PromptDataset(DataConfig(), tok, None, split="train")
    assert len(ds) == 25 and ds.data_sources() == {"mgrpo/sum"} and ds.num_filtered == 0
    b1 = ds.next_batch()
    assert len(b1) == 32 and ds.epoch == 1
    assert sorted(_ids(b1[:25])) == list(range(25))           # the first epoch is a permutation
    it = b1[0]
    assert it.prompt_text == tok.decode(it.prompt_ids) and it.prompt_text.endswith("=")
    assert it.ground_truth == str(it.extra_info["a"] + it.extra_info["b"])
    val = PromptDataset(DataConfig(), tok, None, split="val")
    assert [it.prompt_text for it in val.all_items()] == [f"{a}+{b}=" for a in range(5) for b in range(5)]
    assert len(val.all_items(limit=3)) == 3


def test_shuffle_is_seeded():
    tok = synthetic_tokenizer()
    a = PromptDataset(DataConfig(seed=3), tok).next_batch(50)
    b = PromptDataset(DataConfig(seed=3), tok).next_batch(50)
    c = PromptDataset(DataConfig(seed=4), tok).next_batch(50)
    assert _ids(a) == _ids(b) and _ids(a) != _ids(c)
    assert _ids(a[:25]) != _ids(a[25:])                         # a new permutation each epoch
    plain = PromptDataset(DataConfig(shuffle=False), tok).next_batch(30)
    assert _ids(plain) == list(range(25)) + list(range(5))


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_resume_continues_the_same_stream(k):
    tok = synthetic_tokenizer()
    cfg = DataConfig(train_batch_size=10, seed=11)
    original = PromptDataset(cfg, tok)
    for _ in range(k):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))        # it goes through a JSON checkpoint
    resumed = PromptDataset(cfg, tok)
    resumed.load_state_dict(state)
    for _ in range(6):                                           # crosses at least two epoch boundaries
        assert _ids(resumed.next_batch()) == _ids(original.next_batch())
    assert resumed.epoch == original.epoch


def test_resume_rejects_a_changed_dataset():
    tok = synthetic_tokenizer()
    state = PromptDataset(DataConfig(), tok).state_dict()
    with pytest.raises(ValueError, match="saved for 25 prompts but the dataset now has 9"):
        PromptDataset(DataConfig(synthetic_max_operand=2), tok).load_state_dict(state)


def test_prompts_tokenized_in_batches_equal_one_by_one(tmp_path, qwen3, monkeypatch):
    """PromptDataset tokenizes TOKENIZE_BATCH prompts per call (memory): every prompt's ids are those of its own
    text, across batch edges, and an overlong prompt in the middle is dropped."""
    import mgrpo.data.dataset as dataset_module

    monkeypatch.setattr(dataset_module, "TOKENIZE_BATCH", 4)
    rows = [_rec(i, prompt=[{"role": "user", "content": f"question {i}: " + "x y " * i}]) for i in range(11)]
    rows[6] = _rec(6, prompt=[{"role": "user", "content": "word " * 300}])
    ds = PromptDataset(DataConfig(train_files=[_jsonl(tmp_path / "t.jsonl", rows)], max_prompt_length=200), qwen3)
    assert [it.ground_truth for it in ds.items] == [str(i) for i in range(11) if i != 6] and ds.num_filtered == 1
    for it in ds.items:
        assert it.prompt_ids == qwen3(it.prompt_text, add_special_tokens=False)["input_ids"]
        assert it.prompt_text.startswith("<|im_start|>user\nquestion ")


def test_files_are_mixed_filtered_and_templated(tmp_path, qwen3):
    long_q = [{"role": "user", "content": "word " * 200}]
    a = _jsonl(tmp_path / "a.jsonl", [_rec(i) for i in range(6)] + [_rec(99, prompt=long_q)])
    b = str(tmp_path / "b.parquet")
    write_records(b, [_rec(i, source="math") for i in range(10, 14)])
    cfg = DataConfig(train_files=[a, b], max_prompt_length=64, train_batch_size=4)
    ds = PromptDataset(cfg, qwen3, split="train")
    assert len(ds) == 10 and ds.num_filtered == 1 and ds.filtered_by_source == {"openai/gsm8k": 1}
    assert ds.data_sources() == {"openai/gsm8k", "math"}
    it = ds.all_items()[0]
    assert it.prompt_text == ("<|im_start|>user\nquestion 0<|im_end|>\n<|im_start|>assistant\n"
                              "<think>\n\n</think>\n\n")   # enable_thinking=False closes the think block
    assert it.prompt_ids == qwen3(it.prompt_text, add_special_tokens=False)["input_ids"]
    thinking = PromptDataset(replace(cfg, enable_thinking=True), qwen3, [a])
    assert thinking.all_items()[0].prompt_text.endswith("<|im_start|>assistant\n")
    # both files show up in the first epoch's batches
    seen = {it.data_source for _ in range(3) for it in ds.next_batch()}
    assert seen == {"openai/gsm8k", "math"}
    # train files but no val files: the val split is empty (not the synthetic task)
    assert len(PromptDataset(cfg, qwen3, split="val")) == 0


def test_chat_prompt_with_synthetic_tokenizer_names_the_record(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [_rec(0)])
    with pytest.raises(RecordError, match=r"t.jsonl:1: field 'prompt' is a list of chat messages but the "
                                          "tokenizer has no chat template"):
        PromptDataset(DataConfig(train_files=[path]), synthetic_tokenizer())


def test_all_prompts_too_long_is_an_error():
    with pytest.raises(ValueError, match="longer than data.max_prompt_length=3"):
        PromptDataset(DataConfig(max_prompt_length=3), synthetic_tokenizer())


# --- packing -------------------------------------------------------------------------------------

def test_pack_micro_batches():
    lengths = [5, 9, 3, 9, 2, 7, 1, 4]
    groups = pack_micro_batches(lengths, 20)
    assert sorted(i for g in groups for i in g) == list(range(8))              # every sample exactly once
    assert all(len(g) * max(lengths[i] for i in g) <= 20 for g in groups)     # padded size under budget
    assert groups == [[1, 3], [5, 0], [7, 2, 4, 6]]                           # longest first, ties in order
    assert pack_micro_batches(lengths, 20) == groups                          # deterministic


def test_pack_over_budget_and_min_micro_batches():
    lengths = [30, 4, 4, 4]
    groups = pack_micro_batches(lengths, 16)
    assert groups == [[0], [1, 2, 3]] and over_budget(lengths, 16) == [0]
    forced = pack_micro_batches(lengths, 16, min_micro_batches=3)
    assert len(forced) == 3 and sorted(i for g in forced for i in g) == [0, 1, 2, 3]
    assert [0] in forced                                                       # the long one is never split
    with pytest.raises(ValueError):
        pack_micro_batches(lengths, 16, min_micro_batches=5)
