"""model.tokenizer=printable: characters, Qwen3's special tokens, its chat template (checked against the real Qwen3
template), the vocabulary that follows it, and records it cannot represent refused by file:line and field."""

from __future__ import annotations

import json
import re

import pytest

from mgrpo.config import ConfigError, DataConfig, ModelConfig
from mgrpo.config.vocab import BUILTIN_TOKENIZER_VOCAB
from mgrpo.data import PromptDataset, RecordError, check_vocab, load_tokenizer, printable_tokenizer, synthetic_tokenizer
from mgrpo.data.printable import ADDED, CHARACTERS, SPECIAL

PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F)) + "\t\n"


@pytest.fixture(scope="module")
def tok():
    return printable_tokenizer()


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer(ModelConfig(tokenizer="qwen3"))


def test_every_printable_character_is_one_token_and_decodes_back(tok):
    assert len(PRINTABLE) == 97 == len(CHARACTERS)
    ids = tok(PRINTABLE, add_special_tokens=False)["input_ids"]
    assert len(ids) == 97 and len(set(ids)) == 97 and tok.unk_token_id not in ids
    assert tok.decode(ids) == PRINTABLE  # whitespace kept, no spaces added between characters
    text = "def f(x):\n\treturn {'a': [x, \"y\"]}  # ~`|\\^"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok) == 107 == BUILTIN_TOKENIZER_VOCAB["printable"]


def test_special_tokens_are_qwen3s_with_qwen3s_roles(tok, qwen3):
    # each of Qwen3's tags is one token, and special (dropped by skip_special_tokens) exactly when it is in Qwen3
    for t in SPECIAL + ADDED:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
        assert len(qwen3(t, add_special_tokens=False)["input_ids"]) == 1, t
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    ours = tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    theirs = qwen3.decode(qwen3(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
    assert ours == theirs == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert (tok.eos_token, tok.pad_token) == (qwen3.eos_token, qwen3.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_unrepresentable_character_encodes_as_unk(tok):
    ids = tok("café", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.unk_token_id and len(ids) == 4


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Reverse: abc"}],
    "system+user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\tthere"}],
    "tool round trip": [
        {"role": "system", "content": "You add."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                        {"type": "function", "function": {"name": "add", "arguments": '{"a": 0, "b": 1}'}}]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 1+1?"},
    ],
}


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_template_renders_as_qwen3s(tok, qwen3, name, thinking):
    """Without a tools list (where the preamble is deliberately shorter), the minimal template renders exactly
    what Qwen3's own template renders, generation prompt and empty think block included."""
    msgs = CONVERSATIONS[name]
    ours = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    theirs = qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    assert ours == theirs
    assert tok.unk_token_id not in tok(ours, add_special_tokens=False)["input_ids"]


def test_chat_template_tools_in_the_system_message(tok, qwen3):
    tools = [{"type": "function", "function": {"name": "add", "description": "a+b",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    msgs = CONVERSATIONS["tool round trip"]
    ours = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    theirs = qwen3.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    system, rest = ours.split("<|im_end|>\n", 1)
    assert system == "<|im_start|>system\nYou add.\n\n# Tools\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>"
    assert rest == theirs.split("<|im_end|>\n", 1)[1]  # every turn after the system message: Qwen3's
    # the assistant's calls as SGLang's qwen25 detector reads them: <tool_call>\n{json}\n</tool_call>
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", rest, re.S)
    assert [json.loads(c) for c in calls] == [{"name": "add", "arguments": {"a": 2, "b": 3}},
                                               {"name": "add", "arguments": {"a": 0, "b": 1}}]
    with pytest.raises(Exception, match="unknown chat role narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_saved_and_reloaded_as_a_checkpoint_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    msgs = CONVERSATIONS["tool round trip"]
    assert again.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    text = "<|im_start|>user\nx y<|im_end|>\n<tool_call>"
    assert again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert (again.eos_token_id, again.pad_token_id, len(again)) == (tok.eos_token_id, tok.pad_token_id, len(tok))


def test_vocabulary_follows_the_tokenizer():
    from hydra import compose, initialize_config_dir

    from mgrpo_launchers.train import CONFIG_DIR, to_config

    def vocab(*overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return to_config(compose(config_name="config", overrides=list(overrides))).model.vocab_size

    assert vocab() == 16 and vocab("model.tokenizer=printable") == len(printable_tokenizer())
    assert vocab("model=tiny-moe", "model.tokenizer=printable") == 107
    assert vocab("model.tokenizer=printable", "model.vocab_size=128") == 128  # an explicit size wins
    with pytest.raises(Exception, match="give model.vocab_size=N"):
        vocab("model.tokenizer=/some/dir")
    check_vocab(synthetic_tokenizer(), ModelConfig())
    with pytest.raises(ConfigError, match=re.escape("model.vocab_size=16 is smaller than model.tokenizer='printable' "
                                                    "(107 tokens): set model.vocab_size=107")):
        check_vocab(printable_tokenizer(), ModelConfig(tokenizer="printable"))


def _write(path, prompts):
    path.write_text("".join(json.dumps({"data_source": "my/task", "prompt": p,
                                        "reward_model": {"ground_truth": "x"}}) + "\n" for p in prompts))
    return str(path)


def test_dataset_renders_chat_and_string_records(tok, tmp_path):
    f = _write(tmp_path / "t.jsonl", ["Reverse: abc", [{"role": "user", "content": "Upper: b"}]])
    ds = PromptDataset(DataConfig(train_files=[f], max_prompt_length=64), tok)
    assert [it.prompt_text for it in ds.items] == [
        "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|>user\nUpper: b<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    # <|im_start|> user\n (5) Reverse: abc (12) <|im_end|> \n <|im_start|> assistant\n (10) <think> \n\n </think> \n\n
    assert len(ds.items[0].prompt_ids) == 1 + 5 + 12 + 1 + 1 + 1 + 10 + 1 + 2 + 1 + 2


@pytest.mark.parametrize("prompt, message", [
    ("naïve", "t.jsonl:2: field 'prompt': character 'ï' (U+00EF) at position 3 is not in the tokenizer's vocabulary: "
              "it would become <unk>"),
    ([{"role": "system", "content": "ok"}, {"role": "user", "content": "a→b, c→d"}],
     "t.jsonl:2: field 'prompt[1].content': character '→' (U+2192) at position 2 is not in the tokenizer's vocabulary "
     "(and 1 more): it would become <unk>"),
])
def test_unrepresentable_character_is_refused_by_file_line_and_field(tok, tmp_path, prompt, message):
    f = _write(tmp_path / "t.jsonl", ["fine", prompt])
    with pytest.raises(RecordError, match=re.escape(f"{tmp_path}/{message}")):
        PromptDataset(DataConfig(train_files=[f]), tok)


def test_synthetic_tokenizer_refuses_what_it_cannot_represent(tmp_path):
    f = _write(tmp_path / "t.jsonl", ["1+2=", "1*2="])
    with pytest.raises(RecordError, match=re.escape("t.jsonl:2: field 'prompt': character '*' (U+002A) at position 2")):
        PromptDataset(DataConfig(train_files=[f]), synthetic_tokenizer())
