"""An HF checkpoint's config.json without torch: read it, find its model family, map it to ModelConfig fields.

Used where a model directory is named but nothing may be loaded: veRL's `actor_rollout_ref.model.path`
(mgrpo.compat.verl) and the planner (mgrpo-plan works from config.json alone). The field mapping itself
belongs to the family (`ModelFamily.hf_json_fields`), so a new family never edits this module.
"""

from __future__ import annotations

import glob
import json
import math
import os
from types import SimpleNamespace
from typing import Optional

from mgrpo.config import InputError, ModelConfig
from mgrpo.models.registry import family_for_hf, family_of

CONFIG = "config.json"
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""Files whose presence means the directory ships its own tokenizer."""


def read_hf_config(hf_dir: str) -> dict:
    """The raw config.json of an HF checkpoint directory (FileNotFoundError / ValueError naming the file)."""
    if not os.path.exists(hf_dir):
        raise FileNotFoundError(f"HF checkpoint directory: {hf_dir} does not exist")
    path = os.path.join(hf_dir, CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"HF checkpoint has no config.json: {path} does not exist")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: not valid JSON ({e})") from e


def checkpoint_identity(hf_dir: str, family, vocab_size: int) -> dict:
    """The ModelConfig fields that come from the directory rather than the architecture: its name, its
    family and its tokenizer (the directory's own files, else the family's default for the vocabulary)."""
    has_tokenizer = any(os.path.exists(os.path.join(hf_dir, f)) for f in TOKENIZER_MARKERS)
    return {"name": os.path.basename(os.path.normpath(hf_dir)), "family": family.name,
            "tokenizer": hf_dir if has_tokenizer else family.default_tokenizer(vocab_size)}


def hf_architecture(hf_dir: str) -> dict:
    """ModelConfig fields (identity and architecture) of the checkpoint in hf_dir, from config.json alone."""
    raw = read_hf_config(hf_dir)
    family = family_for_hf(raw.get("model_type"), os.path.join(hf_dir, CONFIG))
    try:
        fields = family.hf_json_fields(raw)
    except ValueError as e:
        raise InputError(f"{os.path.join(hf_dir, CONFIG)}: {e}") from None
    return {**checkpoint_identity(hf_dir, family, fields["vocab_size"]), **fields}


def _raw_view(family, raw: dict) -> SimpleNamespace:
    """config.json as the attribute view `ModelFamily.hf_unsupported` reads (getattr with defaults), without
    transformers' config classes: those import torch (transformers' modeling_rope_utils), and the driver checks
    a checkpoint it never loads, without torch. The family's architecture fields go over the raw keys, normalised
    across transformers versions (5.x writes a MoE's expert count as num_local_experts) with its defaults."""
    return SimpleNamespace(**{**raw, **family.hf_json_fields(raw)})


def check_hf_config(hf_dir: str, model: ModelConfig) -> None:
    """Raise ValueError naming every config.json field that disagrees with `model`, and every variant the
    family does not implement. From config.json alone, no torch: the driver runs it before any process starts."""
    path = os.path.join(hf_dir, CONFIG)
    family = family_of(model)
    raw = read_hf_config(hf_dir)
    if raw.get("model_type") != family.hf_model_type:
        raise InputError(f"{path}: model_type={raw.get('model_type')!r}, expected {family.hf_model_type!r} "
                         f"(model.family={model.family!r})")
    try:
        have = family.hf_json_fields(raw)  # the mapping hf_model_fields applies to a parsed config
    except ValueError as e:
        raise InputError(f"{path}: {e}") from None
    errors = family.hf_unsupported(_raw_view(family, raw), path)
    for hf_name, ours in family.hf_checked_fields:
        value, want = have.get(ours), getattr(model, ours)
        same = (math.isclose(float(value), float(want), rel_tol=1e-9) if isinstance(want, float)
                and value is not None else value == want)
        if not same:
            errors.append(f"config.json {hf_name}={value} but model.{ours}={want}")
    if errors:
        raise InputError(f"{path} does not match the model config:\n  " + "\n  ".join(errors))


def resolve_hf_dir(path: str) -> Optional[str]:
    """A local checkpoint directory for a model path: the directory itself, or the snapshot of a hub id
    in the local Hugging Face cache (no download)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, CONFIG)):
        return path
    if path.count("/") == 1 and not os.path.exists(path):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
        repo = os.path.join(hub, "models--" + path.replace("/", "--"))
        ref = os.path.join(repo, "refs", "main")
        if os.path.isfile(ref):
            with open(ref) as f:
                snap = os.path.join(repo, "snapshots", f.read().strip())
            if os.path.isfile(os.path.join(snap, CONFIG)):
                return snap
        snaps = sorted(glob.glob(os.path.join(repo, "snapshots", "*", CONFIG)))
        if snaps:
            return os.path.dirname(snaps[-1])
    return None


def teacher_model(teacher_hf_path: str) -> ModelConfig:
    """The on-policy distillation teacher's ModelConfig (teacher.hf_path), from its config.json alone: the
    driver checks it and the planner sizes it without torch; the Megatron ranks build it from the same."""
    return ModelConfig(hf_path=teacher_hf_path, **hf_architecture(teacher_hf_path))
