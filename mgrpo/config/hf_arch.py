"""A Hugging Face Qwen3 checkpoint's architecture from its config.json, without torch or weights.

Used where a model directory is named but nothing may be loaded: veRL's `actor_rollout_ref.model.path`
(mgrpo.config.verl) and the planner (mgrpo-plan works from config.json alone, no safetensors).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional


def resolve_hf_dir(path: str) -> Optional[str]:
    """A local checkpoint directory for veRL's model.path: the directory itself, or the snapshot of a hub
    id in the local Hugging Face cache (no download)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if path.count("/") == 1 and not os.path.exists(path):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
        repo = os.path.join(hub, "models--" + path.replace("/", "--"))
        ref = os.path.join(repo, "refs", "main")
        if os.path.isfile(ref):
            with open(ref) as f:
                snap = os.path.join(repo, "snapshots", f.read().strip())
            if os.path.isfile(os.path.join(snap, "config.json")):
                return snap
        snaps = sorted(glob.glob(os.path.join(repo, "snapshots", "*", "config.json")))
        if snaps:
            return os.path.dirname(snaps[-1])
    return None


def hf_architecture(hf_dir: str) -> dict:
    """ModelConfig fields of the dense Qwen3 in hf_dir/config.json (plain JSON: no torch, no weights)."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"{path}: model_type={raw.get('model_type')!r}; mgrpo trains dense Qwen3 ('qwen3')")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0))
    has_tok = any(os.path.exists(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return {
        "name": os.path.basename(os.path.normpath(hf_dir)),
        "tokenizer": hf_dir if has_tok else ("qwen3" if raw["vocab_size"] == 151936 else "synthetic"),
        "vocab_size": raw["vocab_size"], "hidden_size": raw["hidden_size"], "num_layers": raw["num_hidden_layers"],
        "num_attention_heads": raw["num_attention_heads"],
        "num_query_groups": raw.get("num_key_value_heads", raw["num_attention_heads"]),
        "head_dim": raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
        "ffn_hidden_size": raw["intermediate_size"], "rope_theta": float(theta),
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6), "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_position_embeddings": raw.get("max_position_embeddings", 40960),
    }
