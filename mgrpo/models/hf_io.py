"""Hugging Face checkpoint directories: config.json -> ModelConfig, lazy safetensors reads,
streaming sharded writes, and the seeded random initial checkpoint every from-scratch run starts from.

What is architecture-specific (which config.json fields, which tensors, which transformers classes)
comes from the model family (`model.family`, or config.json's `model_type` when reading a checkpoint).
No process groups here; the converter and launchers decide which rank reads or writes what.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

import torch

from mgrpo.config import ModelConfig
from mgrpo.models.hf_config import CONFIG, checkpoint_identity, read_hf_config
from mgrpo.models.registry import family_for_hf, family_of

GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_PART = ".part-"  # temporary shard names before the final count is known
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# Tensors some HF checkpoints carry that hold no weights (old rotary caches).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


def _need(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what}: {path} does not exist")
    return path


def model_config_from_hf(hf_dir: str) -> ModelConfig:
    """ModelConfig describing the architecture in `hf_dir`/config.json (its family from `model_type`),
    refusing by name the variants the family does not implement."""
    path = os.path.join(hf_dir, CONFIG)
    raw = read_hf_config(hf_dir)
    family = family_for_hf(raw.get("model_type"), path)
    cfg = family.hf_parse_config(raw)
    errors = family.hf_unsupported(cfg, path)
    if errors:
        raise ValueError("; ".join(errors))
    fields = family.hf_model_fields(cfg)
    return ModelConfig(hf_path=hf_dir, **checkpoint_identity(hf_dir, family, fields["vocab_size"]), **fields)


class SafetensorsCheckpoint:
    """The safetensors of one HF directory (single file or sharded with an index), read lazily:
    headers on open, then only the slices asked for."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.dir = hf_dir
        index, single = os.path.join(hf_dir, INDEX), os.path.join(hf_dir, SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
        elif os.path.exists(single):
            weight_map = None
        else:
            raise FileNotFoundError(f"{hf_dir} has neither {SINGLE} nor {INDEX}")
        self._files: dict[str, object] = {}
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        for name in files:
            path = _need(os.path.join(hf_dir, name), f"safetensors shard listed in {INDEX}")
            self._files[name] = safe_open(path, framework="pt", device="cpu")
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._files[SINGLE].keys()}
        else:
            for name, file in weight_map.items():
                if name not in self._files[file].keys():
                    raise ValueError(f"{INDEX} maps {name} to {file}, which does not contain it")
        self.weight_map: dict[str, str] = weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        return self._files[self.weight_map[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors' dtype tag: F32, BF16, F16, F8_E4M3, I64, ..."""
        return self._slice(name).get_dtype()

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The whole tensor (dim None) or rows / columns [start, stop) of it (dim 0 / 1)."""
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        return sl[:, start:stop]


def check_hf_tensors(ckpt: SafetensorsCheckpoint, model: ModelConfig) -> list[str]:
    """Missing, unexpected and mis-shaped tensors of the whole checkpoint, each named (HF and Megatron)."""
    family = family_of(model)
    expected = family.hf_shapes(model)
    megatron = family.megatron_names(model)
    problems = []
    for name, shape in expected.items():
        if name not in ckpt:
            problems.append(f"missing tensor {name} (megatron {megatron[name]})")
        elif ckpt.shape(name) != shape:
            problems.append(f"tensor {name} has shape {list(ckpt.shape(name))} in {ckpt.weight_map[name]}, "
                            f"expected {list(shape)} (megatron {megatron[name]})")
    # Some tied checkpoints also store the untied output head (lm_head); transformers ignores it in
    # favour of the embedding.
    tolerated = set(family.hf_shapes(replace(model, tie_word_embeddings=False))) - set(expected)
    for name in ckpt.names():
        if name not in expected and name not in tolerated and not name.endswith(IGNORED_HF_SUFFIXES):
            problems.append(f"unexpected tensor {name} in {ckpt.weight_map[name]} (no megatron counterpart)")
        elif name in expected and ckpt.dtype(name) not in FLOAT_DTYPES:
            problems.append(f"tensor {name} has dtype {ckpt.dtype(name)}, expected one of {sorted(FLOAT_DTYPES)} "
                            f"(quantized checkpoints are not supported)")
    return problems


# ---------------------------------------------------------------------------------------------
# writing


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage (safetensors refuses tensors sharing memory)."""
    t = t.detach().to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != _nbytes(t) or t.storage_offset() != 0:
        t = t.contiguous().clone()
    return t


@dataclass
class ShardFile:
    path: str
    names: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    nbytes: int = 0
    dtypes: set = field(default_factory=set)


def clear_hf_weights(out_dir: str) -> None:
    """Remove model*.safetensors and the index left by an earlier save into `out_dir`."""
    if os.path.isdir(out_dir):
        for f in os.listdir(out_dir):
            if f.startswith("model") and (f.endswith(".safetensors") or f == INDEX):
                os.remove(os.path.join(out_dir, f))


def write_safetensors_shards(out_dir: str, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                             max_shard_bytes: int, tag: str = "0", on_tensor=None) -> list[ShardFile]:
    """Write a stream to temporary shard files of at most `max_shard_bytes` each (a larger tensor gets
    its own file); holds at most one shard in memory. `finalize_hf_checkpoint` renames them."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    files: list[ShardFile] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal pending, size
        if pending:
            sf = ShardFile(os.path.join(out_dir, f"model{_PART}{tag}-{len(files):05d}.safetensors"))
            save_file(pending, sf.path, metadata={"format": "pt"})
            sf.names = list(pending)
            sf.shapes = {k: tuple(v.shape) for k, v in pending.items()}
            sf.nbytes = size
            sf.dtypes = {str(v.dtype).removeprefix("torch.") for v in pending.values()}
            files.append(sf)
        pending, size = {}, 0

    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice in the stream")
        seen.add(name)
        n = _nbytes(tensor)
        if pending and size + n > max_shard_bytes:
            flush()
        pending[name] = _standalone(tensor)
        size += n
        if on_tensor is not None:
            on_tensor(name, n)
    flush()
    return files


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _tokenizer_ids(tokenizer, tokenizer_dir: Optional[str]) -> dict:
    """The special token ids the exported config.json and generation_config.json carry, so that transformers'
    generate() stops at EOS: from the tokenizer, or from a checkpoint's config.json in `tokenizer_dir`, or from
    the tokenizer saved there (a run directory's tokenizer/ has no config.json)."""
    if tokenizer is None and tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, CONFIG)):
        src = read_hf_config(tokenizer_dir)
        ids = {k: src[k] for k in SPECIAL_IDS if src.get(k) is not None}
        if ids.get("eos_token_id") is not None:
            return ids
    if tokenizer is None and tokenizer_dir and any(os.path.exists(os.path.join(tokenizer_dir, f))
                                                   for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer is None:
        return {}
    return {k: getattr(tokenizer, k) for k in SPECIAL_IDS if getattr(tokenizer, k, None) is not None}


def finalize_hf_checkpoint(out_dir: str, files: list[ShardFile], model_cfg: ModelConfig, *, tokenizer=None,
                           tokenizer_dir: Optional[str] = None) -> None:
    """Check the written tensors are exactly the model's, name the shards, write the index,
    config.json, generation_config.json and the tokenizer files."""
    from transformers import GenerationConfig

    family = family_of(model_cfg)
    written = {k: s for f in files for k, s in f.shapes.items()}
    expected = family.hf_shapes(model_cfg)
    problems = [f"tensor {k} written twice" for k in written if sum(k in f.shapes for f in files) > 1]
    problems += [f"missing tensor {k}" for k in expected if k not in written]
    problems += [f"unexpected tensor {k}" for k in written if k not in expected]
    problems += [f"tensor {k} has shape {list(s)}, expected {list(expected[k])}"
                 for k, s in written.items() if k in expected and s != expected[k]]
    if problems:
        for f in files:
            os.remove(f.path)
        raise ValueError(f"refusing to write an HF checkpoint to {out_dir}:\n  " + "\n  ".join(problems))

    if len(files) == 1:
        os.replace(files[0].path, os.path.join(out_dir, SINGLE))
    else:
        weight_map = {}
        for i, f in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.replace(f.path, os.path.join(out_dir, final))
            weight_map.update({k: final for k in f.names})
        index = {"metadata": {"total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
        with open(os.path.join(out_dir, INDEX), "w") as fh:
            json.dump(index, fh, indent=2)

    dtypes = set().union(*(f.dtypes for f in files))
    ids = _tokenizer_ids(tokenizer, tokenizer_dir)
    config = family.hf_config(model_cfg, dtype=dtypes.pop() if len(dtypes) == 1 else "float32",
                              architectures=[family.hf_architecture], **ids)
    config.save_pretrained(out_dir)

    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    elif tokenizer_dir:
        _need(tokenizer_dir, "tokenizer directory")
        copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, f))]
        if not copied and not os.path.exists(os.path.join(tokenizer_dir, GENERATION_CONFIG)):
            raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} has none of "
                                    f"{list(TOKENIZER_FILES) + [GENERATION_CONFIG]}")
        for f in copied:
            shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
    source_gen = os.path.join(tokenizer_dir, GENERATION_CONFIG) if tokenizer_dir else None
    if source_gen and os.path.exists(source_gen):
        shutil.copyfile(source_gen, os.path.join(out_dir, GENERATION_CONFIG))
    elif ids.get("eos_token_id") is not None:
        # Only the special tokens: sampling settings belong to the rollout config, not the checkpoint.
        GenerationConfig(**ids).save_pretrained(out_dir)


def save_hf_checkpoint(out_dir: str, named_tensors: Iterable[tuple[str, torch.Tensor]], model_cfg: ModelConfig, *,
                       tokenizer=None, tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 2**30) -> None:
    """Write a transformers-loadable checkpoint of `model_cfg`'s family from a stream of (HF name, tensor).

    The stream must hold exactly the model's tensors (checked before naming the files); it is
    written shard by shard, so at most `max_shard_bytes` of it is held in memory. One shard is
    written as model.safetensors, several with model.safetensors.index.json.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    clear_hf_weights(out_dir)
    files = write_safetensors_shards(out_dir, named_tensors, max_shard_bytes=max_shard_bytes)
    finalize_hf_checkpoint(out_dir, files, model_cfg, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)


def init_hf_checkpoint(out_dir: str, model_cfg: ModelConfig, seed: int, tokenizer=None) -> str:
    """A randomly initialised transformers model of `model_cfg` (its family's class and transformers'
    own init, seeded) saved to `out_dir`.

    Every from-scratch run starts from such a directory, so all TP/PP layouts and the rollout
    engine start from the same weights. `tokenizer` is a tokenizer object (saved with it) or a
    directory to copy tokenizer files from. Returns `out_dir`.
    """
    family = family_of(model_cfg)
    fork_devices = []  # keep the caller's CPU RNG stream untouched
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = family.hf_model(family.hf_config(model_cfg)).float()
    state = family.hf_named_tensors(model)  # checkpoint names (transformers 5 fuses MoE experts in memory)
    names = list(family.hf_shapes(model_cfg))
    tok_obj, tok_dir = (None, tokenizer) if isinstance(tokenizer, str) else (tokenizer, None)
    save_hf_checkpoint(out_dir, ((n, state[n]) for n in names), model_cfg, tokenizer=tok_obj, tokenizer_dir=tok_dir)
    return out_dir
