"""Model weights in megatron-core's distributed checkpoint format (megatron.core.dist_checkpointing).

Each rank writes its shards under global keys (layer numbers are global, TP shards carry their
offsets, gate/up of linear_fc1 are stored as two tensors), so a checkpoint saved at one TP/PP
layout loads at any other. The local and the Transformer Engine specs use the same keys (the
local spec maps its norms onto TE's fused `layer_norm_weight` keys), so the two specs interchange.
Every rank of the model's world calls these together; over gloo this works on CPU.
"""

from __future__ import annotations

import os

from mgrpo.models.hf_checkpoint import unwrap

# Weights only: the trainer stores optimizer / RNG / data state next to them in its own files.
WEIGHTS_MARKER = "metadata.json"


def save_megatron_checkpoint(model, ckpt_dir: str) -> None:
    """Save one pipeline stage's weights (every rank of the world calls this with its stage)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(unwrap(model).sharded_state_dict(), ckpt_dir)


def load_megatron_checkpoint(model, ckpt_dir: str) -> None:
    """Load weights saved by `save_megatron_checkpoint` at any TP/PP layout into this stage.

    A checkpoint lacking a tensor this stage needs is an error naming the key (nothing is loaded).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not os.path.exists(os.path.join(ckpt_dir, WEIGHTS_MARKER)):
        raise FileNotFoundError(f"{ckpt_dir} is not a megatron distributed checkpoint (no {WEIGHTS_MARKER})")
    model = unwrap(model)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir, strict=StrictHandling.RAISE_UNEXPECTED)
    # Keys of the stage that the checkpoint could not provide were refused above; `_extra_state`
    # (TE's FP8 metadata, None in the local spec) may legitimately differ between specs.
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"loading {ckpt_dir}: missing {missing}, unexpected {unexpected}")

