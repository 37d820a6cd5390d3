"""mgrpo-reward and mgrpo-prepare on bad input: one or two lines naming file:line:field, exit status 2, no
traceback; and mgrpo-reward --help shows an input line, which scores as the help says."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

GOOD = {"data_source": "openai/gsm8k", "response": "#### 7", "ground_truth": "7"}


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120, cwd=cwd, env=dict(os.environ))


def assert_clean_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and 1 <= len(out.stderr.strip().splitlines()) <= 2, out.stderr
    for n in needles:
        assert n in out.stderr, (n, out.stderr)


def write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.integration
def test_reward_help_shows_an_input_line_that_scores_as_shown(tmp_path):
    help_text = run("mgrpo-reward", "--help", cwd=tmp_path).stdout
    lines = help_text.splitlines()
    example = lines[lines.index("an input line (JSONL, one response per line):") + 1].strip()
    scored = lines[lines.index("the same line in --out:") + 1].strip()
    src = write(tmp_path / "in.jsonl", [example])
    out = run("mgrpo-reward", "--in", src, "--out", str(tmp_path / "out.jsonl"), "--num-workers", "0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text()) == json.loads(scored)


@pytest.mark.integration
@pytest.mark.parametrize("lines, needles", [
    ([json.dumps(GOOD), '{"data_source": "openai/gsm8k", "response": '], ["in.jsonl:2:", "not valid JSON"]),
    ([json.dumps({"data_source": "openai/gsm8k", "response": "#### 7", "reward_model": {"style": "rule"}})],
     ["in.jsonl:1:", "'ground_truth' (or 'reward_model.ground_truth') missing"]),
    ([json.dumps({**GOOD, "response": 7})], ["in.jsonl:1:", "field 'response' must be a string"]),
    ([json.dumps({**GOOD, "data_source": "my/unknown"})], ["no reward function for data_source 'my/unknown'"]),
])
def test_reward_bad_input(tmp_path, lines, needles):
    src = write(tmp_path / "in.jsonl", lines)
    out = run("mgrpo-reward", "--in", src, "--out", str(tmp_path / "out.jsonl"), cwd=tmp_path)
    assert_clean_error(out, *needles)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.integration
def test_reward_record_form_and_unwritable_output(tmp_path):
    record = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "3+4?"}], "response": "#### 7",
              "reward_model": {"ground_truth": "7", "style": "rule"}}
    src = write(tmp_path / "in.jsonl", [json.dumps(record)])
    ok = run("mgrpo-reward", "--in", src, "--out", str(tmp_path / "out.jsonl"), "--num-workers", "0", cwd=tmp_path)
    assert ok.returncode == 0 and json.loads((tmp_path / "out.jsonl").read_text())["score"] == 1.0
    out = run("mgrpo-reward", "--in", src, "--out", str(tmp_path / "no" / "such" / "dir.jsonl"), cwd=tmp_path)
    assert_clean_error(out, "--out", "cannot write")


@pytest.mark.integration
@pytest.mark.parametrize("lines, needles", [
    ([json.dumps({"question": "q", "answer": "#### 1"}), '{"question": "q"'], ["train.jsonl:2:", "not valid JSON"]),
    ([json.dumps({"question": "q"})], ["train.jsonl:1:", "field 'answer' missing"]),
    ([json.dumps({"question": "q", "answer": "it is 1"})], ["train.jsonl:1:", "'answer' does not end with '#### "]),
])
def test_prepare_bad_input(tmp_path, lines, needles):
    raw = tmp_path / "raw"
    raw.mkdir()
    write(raw / "train.jsonl", lines)
    write(raw / "test.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})])
    out = run("mgrpo-prepare", "gsm8k", "--input-dir", str(raw), "--out-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert_clean_error(out, *needles)
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.integration
def test_prepare_unwritable_output(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for split in ("train", "test"):
        write(raw / f"{split}.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})])
    (tmp_path / "file").write_text("")
    out = run("mgrpo-prepare", "gsm8k", "--input-dir", str(raw), "--out-dir", str(tmp_path / "file" / "out"),
              cwd=tmp_path)
    assert_clean_error(out, "file/out")
