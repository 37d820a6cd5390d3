"""Tiny reward models for tests: random-initialised sequence classifiers saved as HF checkpoints."""

from __future__ import annotations

import torch

from mgrpo.data.synthetic import synthetic_tokenizer


def tiny_classifier(out_dir: str, family: str = "qwen3", seed: int = 0) -> str:
    """A tiny sequence classifier (one score) with the synthetic tokenizer, saved as an HF checkpoint."""
    from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen3Config,
                              Qwen3ForSequenceClassification)

    torch.manual_seed(seed)
    common = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_labels=1, pad_token_id=0, eos_token_id=1,
                  bos_token_id=None, tie_word_embeddings=False)
    if family == "qwen3":
        model = Qwen3ForSequenceClassification(Qwen3Config(head_dim=8, **common))
    else:
        model = LlamaForSequenceClassification(LlamaConfig(**common))
    with torch.no_grad():  # a score head that is not near zero, so comparisons mean something
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out_dir)
    synthetic_tokenizer().save_pretrained(out_dir)
    return out_dir
