"""Load an HF checkpoint directory into one Megatron pipeline stage.

Each rank reads only the slices its stage and TP rank hold (safetensors' lazy slicing); every
check runs first, so a wrong checkpoint is refused before any weight changes. Which HF tensors make
each parameter is the model family's table; the sharding rules live in `shapes.py` / `layout.py`;
the way back (Megatron -> HF) is `weight_iter.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mgrpo.config import ModelConfig
from mgrpo.models.hf_config import check_hf_config
from mgrpo.models.hf_io import SafetensorsCheckpoint, check_hf_tensors
from mgrpo.models.layout import shard_from_hf
from mgrpo.models.registry import family_of
from mgrpo.models.shapes import Dims, Weight, local_shape


def unwrap(model):
    """The GPTModel inside DDP / Float16Module-style wrappers (all of them expose `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@dataclass
class Stage:
    """What the converter needs from one pipeline stage of a GPTModel."""

    params: dict[str, torch.nn.Parameter]
    layers: list[int]
    """Global index of each local decoder layer."""
    pre_process: bool
    post_process: bool
    experts: Optional[list[int]] = None
    """Global index of each local expert of a mixture-of-experts stage (the same in every layer); None
    for a dense one."""

    @classmethod
    def of(cls, model) -> "Stage":
        model = unwrap(model)
        decoder_layers = list(model.decoder.layers) if hasattr(model, "decoder") else []
        layers = [layer.layer_number - 1 for layer in decoder_layers]
        # LoRA adapters (`<linear>.lora_A/B`) are not base weights: exported merged or as a PEFT adapter
        from mgrpo.config.lora import is_adapter_param

        params = {k: p for k, p in model.named_parameters() if p.numel() > 0 and not is_adapter_param(k)}
        experts = next((list(layer.mlp.local_expert_indices) for layer in decoder_layers
                        if hasattr(layer.mlp, "local_expert_indices")), None)
        return cls(params, layers, bool(model.pre_process), bool(model.post_process), experts)

    def vocab_padded(self, tp_size: int) -> Optional[int]:
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in self.params:
                return self.params[name].shape[0] * tp_size
        return None

    def weights(self, cfg: ModelConfig, experts: Optional[list[int]] = None) -> list[Weight]:
        """The stage's weights; `experts` (global indices) names another expert-parallel rank's experts
        in place of this stage's own (same Megatron names, the other rank's HF names)."""
        experts = self.experts if experts is None else experts
        kw = {"experts": experts} if experts is not None else {}
        return family_of(cfg).stage_weights(cfg, layers=self.layers, pre_process=self.pre_process,
                                            post_process=self.post_process, param_names=set(self.params), **kw)

    def check(self, cfg: ModelConfig, d: Dims, weights: list[Weight]) -> list[str]:
        """Megatron parameters the mapping does not know, misses, or expects in another shape."""
        problems = []
        known = {w.megatron for w in weights}
        for name in self.params:
            if name not in known:
                problems.append(f"megatron parameter {name} has no HF counterpart")
        for w in weights:
            p = self.params.get(w.megatron)
            if p is None:
                problems.append(f"megatron parameter {w.megatron} (HF {', '.join(w.hf)}) is missing from the model")
            elif tuple(p.shape) != local_shape(w, d):
                problems.append(f"megatron parameter {w.megatron} has shape {list(p.shape)}, expected "
                                f"{list(local_shape(w, d))} for HF {', '.join(w.hf)} at tp={d.tp}")
        return problems


def raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems))


def check_stage_layout(cfg: ModelConfig, stage: Stage, tp_size: int, pp_rank: int, pp_size: int) -> Dims:
    if pp_size == 1 and not (stage.pre_process and stage.post_process):
        raise ValueError("pp_size=1 but the model is not a whole model (pre_process and post_process)")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside pp_size={pp_size}")
    d = Dims.of(cfg, tp_size, stage.vocab_padded(tp_size))
    d.check_tp()
    return d


def load_hf_into_megatron(model, hf_dir: str, model_cfg: ModelConfig, *, tp_rank: int, tp_size: int, pp_rank: int,
                          pp_size: int, on_weight: Optional[Callable[[str], None]] = None) -> None:
    """Fill one unwrapped pipeline stage from an HF directory (config.json + safetensors).

    Every check runs before any weight is copied and covers the whole checkpoint on every rank, so
    all ranks refuse together: config.json against `model_cfg`, then missing, unexpected and
    mis-shaped tensors (named by HF and Megatron name), then the stage's own parameters. Each rank
    reads only its slices; padded vocabulary rows become zeros. A tied checkpoint that also stores
    lm_head.weight loads like transformers loads it: the embedding is the output layer.
    `on_weight(megatron_name)` is called after each parameter is filled (progress bars).
    """
    check_hf_config(hf_dir, model_cfg)
    stage = Stage.of(model)
    d = check_stage_layout(model_cfg, stage, tp_size, pp_rank, pp_size)
    weights = stage.weights(model_cfg)
    ckpt = SafetensorsCheckpoint(hf_dir)
    where = f"cannot load {hf_dir} into Megatron stage pp_rank={pp_rank} tp_rank={tp_rank}"
    raise_problems(where, check_hf_tensors(ckpt, model_cfg) + stage.check(model_cfg, d, weights))
    with torch.no_grad():
        for w in weights:
            stage.params[w.megatron].copy_(shard_from_hf(w, ckpt.read, d, tp_rank))
            if on_weight is not None:
                on_weight(w.megatron)
