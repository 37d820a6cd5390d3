"""The HF export a run writes at its end (run_dir/hf, from the tokenizer the run saved to run_dir/tokenizer)
carries the EOS id in config.json and generation_config.json, so transformers' generate() stops there."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mgrpo.config import ModelConfig
from mgrpo.data import load_tokenizer
from mgrpo.models import save_hf_checkpoint
from mgrpo.models.registry import family_of


class EosAt:
    """A logits processor that makes the `k`-th new token EOS (and nothing else possible then): generation
    can only stop there if generate() knows the EOS id."""

    def __init__(self, prompt_len: int, k: int, eos: int):
        self.at, self.eos = prompt_len + k - 1, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.eos] = 0.0
        else:
            scores[:, self.eos] = float("-inf")
        return scores


@pytest.mark.parametrize("tokenizer", ["synthetic", "qwen3"])
def test_exported_checkpoint_stops_at_eos(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    vocab = 16 if tokenizer == "synthetic" else 151936
    cfg = ModelConfig(tokenizer=tokenizer, vocab_size=vocab, hidden_size=32, num_layers=1, num_attention_heads=2,
                      num_query_groups=1, head_dim=16, ffn_hidden_size=64)
    tok = load_tokenizer(cfg)
    assert tok.eos_token_id is not None
    # what the loop does at the end of a run: save the tokenizer, export the weights next to it
    tok_dir, out = str(tmp_path / "tokenizer"), str(tmp_path / "hf")
    tok.save_pretrained(tok_dir)
    assert not os.path.exists(os.path.join(tok_dir, "config.json"))
    family = family_of(cfg)
    torch.manual_seed(0)
    state = family.hf_model(family.hf_config(cfg)).state_dict()
    save_hf_checkpoint(out, ((n, state[n]) for n in family.hf_shapes(cfg)), cfg, tokenizer_dir=tok_dir)

    config = json.load(open(os.path.join(out, "config.json")))
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert config["eos_token_id"] == generation["eos_token_id"] == tok.eos_token_id
    assert config.get("pad_token_id") == tok.pad_token_id

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = torch.tensor([[2, 3, 4]])
    processors = LogitsProcessorList([EosAt(prompt.shape[1], 3, tok.eos_token_id)])
    stopped = model.generate(prompt, max_new_tokens=10, do_sample=False, logits_processor=processors)
    assert stopped.shape[1] == prompt.shape[1] + 3 and stopped[0, -1].item() == tok.eos_token_id
    # the same model without the EOS id (as the export was before) runs to max_new_tokens past the EOS token
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    ran = model.generate(prompt, max_new_tokens=10, do_sample=False, logits_processor=processors)
    assert ran.shape[1] == prompt.shape[1] + 10 and ran[0, prompt.shape[1] + 2].item() == tok.eos_token_id
