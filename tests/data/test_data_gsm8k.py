"""GSM8K end to end on the real raw data: converter (mgrpo-prepare), records, and the GSM8K judge."""

from __future__ import annotations

import json
import os
import re

import pytest

from mgrpo.data import RecordError, read_records
from mgrpo.data.gsm8k import DATA_SOURCE, INSTRUCTION, convert_gsm8k
from mgrpo.rewards.gsm8k import compute_score
from mgrpo_launchers.prepare_data import main as prepare_main
from tests.helpers import GSM8K_RAW

RAW = GSM8K_RAW
COUNTS = {"train": 7473, "test": 1319}

pytestmark = pytest.mark.skipif(not os.path.isdir(RAW), reason=f"raw GSM8K not at {RAW}")


def _raw(split):
    with open(os.path.join(RAW, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    assert prepare_main(["gsm8k", "--input-dir", RAW, "--out-dir", str(out), "--format", "parquet"]) == 0
    return out


@pytest.mark.parametrize("split", ["train", "test"])
def test_converter_writes_every_record_as_a_valid_rl_record(converted, split):
    recs = read_records(str(converted / f"{split}.parquet"))   # strict reader: raises on any bad record
    raw = _raw(split)
    assert len(recs) == len(raw) == COUNTS[split]
    for i, (rec, r) in enumerate(zip(recs, raw)):
        assert rec.data_source == DATA_SOURCE and rec.ability == "math"
        assert rec.prompt == [{"role": "user", "content": r["question"] + " " + INSTRUCTION}]
        assert rec.extra_info["split"] == split and rec.extra_info["index"] == i
        final = r["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert rec.ground_truth == final and re.fullmatch(r"-?\d+", rec.ground_truth)


def test_converter_jsonl_matches_parquet(converted, tmp_path):
    convert_gsm8k(RAW, str(tmp_path), "jsonl")
    a = read_records(str(tmp_path / "test.jsonl"))
    b = read_records(str(converted / "test.parquet"))
    assert [(r.prompt, r.ground_truth, r.extra_info) for r in a] == [(r.prompt, r.ground_truth, r.extra_info) for r in b]


def test_converter_names_file_and_line_of_a_malformed_record(tmp_path, capsys):
    lines = _raw("test")[:5]
    lines[3] = {"question": "q", "answer": "no final answer here"}
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(RecordError, match=r"train.jsonl:4: field 'answer' does not end with '#### <number>'"):
        convert_gsm8k(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()   # nothing half-written
    assert prepare_main(["gsm8k", "--input-dir", str(tmp_path), "--out-dir", str(tmp_path / "o")]) == 2
    assert "train.jsonl:4" in capsys.readouterr().err


def _change_final_number(answer: str) -> str:
    head, final = answer.rsplit("####", 1)
    n = int(final.strip().replace(",", ""))
    return f"{head}#### {n + 1}"


def test_judge_scores_every_reference_solution_1_and_wrong_finals_0():
    raw = _raw("test")
    truths = [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in raw]
    right = [compute_score(DATA_SOURCE, r["answer"], gt) for r, gt in zip(raw, truths)]
    assert right.count(1.0) == len(raw) == 1319
    wrong = [compute_score(DATA_SOURCE, _change_final_number(r["answer"]), gt) for r, gt in zip(raw, truths)]
    assert wrong.count(0.0) == len(raw)


def test_converted_split_loads_as_a_prompt_dataset(converted):
    from mgrpo.config import DataConfig, ModelConfig
    from mgrpo.data import PromptDataset, load_tokenizer

    files = [str(converted / "test.parquet")]
    ds = PromptDataset(DataConfig(val_files=files, train_files=files, max_prompt_length=512), load_tokenizer(
        ModelConfig(tokenizer="qwen3")), split="val")
    assert len(ds) + ds.num_filtered == 1319 and ds.num_filtered == 0
    assert ds.data_sources() == {DATA_SOURCE}
    assert ds.all_items()[0].prompt_text.startswith("<|im_start|>user\nJanet")
