"""Megatron -> HF: stream one pipeline stage's weights as full HF tensors, and group them in buckets.

Weight sync to every rollout engine and every HF export go through `iter_megatron_to_hf` and
`bucketize`. Tensor-parallel shards are all-gathered one parameter at a time over the TP group the
caller passes in, so the stream never holds more than one full parameter. A mixture-of-experts stage
holds 1/ep of every layer's experts (whole: TP does not split them); they are all-gathered over the
expert-parallel group one local expert at a time, so the rank that streams the stage emits every
expert, under its global index (one sender per stage, as for a dense model; see `iter_megatron_to_hf`).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, Optional

import torch

from mgrpo.config import ModelConfig
from mgrpo.models.hf_checkpoint import Stage, check_stage_layout, raise_problems
from mgrpo.models.layout import hf_from_shards
from mgrpo.models.shapes import EXPERT_KINDS, REPLICATED, ROUTER


def _dense(p: torch.Tensor) -> torch.Tensor:
    """Plain high-precision values of a parameter: TE's FP8 parameters (fp8_param=True) are
    dequantized with megatron's helpers; everything else is returned as is."""
    from megatron.core.fp8_utils import dequantize_fp8_tensor, is_float8tensor

    p = p.detach()
    return dequantize_fp8_tensor(p) if is_float8tensor(p) else p


def _gather(t: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """All TP shards stacked [tp, *shape], gathered straight into one buffer (no concatenation copy)."""
    import torch.distributed as dist

    out = torch.empty((tp_size, *t.shape), dtype=t.dtype, device=t.device)
    dist.all_gather(list(out.unbind(0)), t.contiguous(), group=tp_group)
    return out


def iter_megatron_to_hf(model, model_cfg: ModelConfig, *, tp_group, tp_size: int, pp_rank: int,
                        pp_size: int, ep_group=None, ep_size: int = 1, dense: bool = True,
                        experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's weights as (HF name, full HF-layout tensor), global layer indices.

    One parameter at a time: TP shards are all-gathered over `tp_group` (every TP rank of the stage
    must iterate, in the same order; all of them receive the full tensors), converted, and yielded;
    nothing else is held. Padded vocabulary rows are stripped. With tied embeddings only the
    embedding is emitted (from the first stage); `lm_head.weight` only when untied (last stage).
    Tensors stay on the parameters' device and may share memory with them.

    Mixture of experts: experts are whole on their expert-parallel rank; with ep_size > 1 each local
    expert is all-gathered over `ep_group` (all its ranks must iterate) and every rank receives all
    experts, named by global index (ep_rank * experts/ep + local index). `dense=False` / `experts=False`
    skip the dense weights / the experts and their collectives, for ranks that take part in only one
    of the two gathers.
    """
    stage = Stage.of(model)
    d = check_stage_layout(model_cfg, stage, tp_size, pp_rank, pp_size)
    for size, group, name in ((tp_size, tp_group, "tp"), (ep_size, ep_group, "ep")):
        if size > 1:
            import torch.distributed as dist

            if dist.get_world_size(group) != size:
                raise ValueError(f"{name}_size={size} but {name}_group has {dist.get_world_size(group)} ranks")
    weights = stage.weights(model_cfg)
    raise_problems(f"cannot export Megatron stage pp_rank={pp_rank}", stage.check(model_cfg, d, weights))
    # the same weights under the HF names of each EP rank's experts (same order, same Megatron names)
    per_ep_rank = [weights] if ep_size == 1 else [
        stage.weights(model_cfg, experts=[r * d.experts // ep_size + i for i in range(d.experts // ep_size)])
        for r in range(ep_size)]
    for k, w in enumerate(weights):
        is_expert = w.kind in EXPERT_KINDS
        if not w.export or not (experts if is_expert else dense):
            continue
        local = _dense(stage.params[w.megatron])
        if is_expert:
            shards = local.unsqueeze(0) if ep_size == 1 else _gather(local, ep_group, ep_size)
            for r in range(ep_size):
                for name, tensor in hf_from_shards(per_ep_rank[r][k], shards[r:r + 1], d):
                    yield name, tensor.contiguous()
            continue
        whole = w.kind in (REPLICATED, ROUTER) or tp_size == 1
        shards = local.unsqueeze(0) if whole else _gather(local, tp_group, tp_size)
        for name, tensor in hf_from_shards(w, shards, d):
            yield name, tensor.contiguous()


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]],
              bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of at most `bucket_bytes` (in stream order);
    a tensor larger than that gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def save_hf_checkpoint_distributed(out_dir: str, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                   model_cfg: ModelConfig, *, writer: bool, stage: int, group=None, tokenizer=None,
                                   tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 2**30,
                                   on_tensor: Optional[Callable[[str, int], None]] = None) -> None:
    """`save_hf_checkpoint` for a pipeline-parallel model: every rank of `group` (default: the world)
    calls it with its own stage's stream (typically `iter_megatron_to_hf`, which all TP ranks must
    iterate); the `writer` ranks, one per stage, write that stage's shards; the group's first rank
    names them in stage order and writes the index, config.json and tokenizer. Any rank's failure
    is raised on every rank."""
    import torch.distributed as dist

    from mgrpo.models.hf_io import clear_hf_weights, finalize_hf_checkpoint, write_safetensors_shards

    first = dist.get_rank(group) == 0 if group is not None else dist.get_rank() == 0
    if first:
        os.makedirs(out_dir, exist_ok=True)
        clear_hf_weights(out_dir)
    dist.barrier(group=group)
    mine, error = None, None
    try:
        if writer:
            mine = (stage, write_safetensors_shards(out_dir, named_tensors, max_shard_bytes=max_shard_bytes,
                                                    tag=str(stage), on_tensor=on_tensor))
        else:
            for _ in named_tensors:  # the TP collectives need every rank to iterate
                pass
    except Exception as e:  # noqa: BLE001  (reported to every rank below instead of hanging them)
        error = f"{type(e).__name__}: {e}"
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (mine, error), group=group)
    errors = [err for _, err in gathered if err]
    if first and not errors:
        writers = sorted((s for s, _ in gathered if s is not None), key=lambda x: x[0])
        stages = [s for s, _ in writers]
        try:
            if len(stages) != len(set(stages)):
                raise ValueError(f"several writers for one pipeline stage: stages {stages}")
            files = [f for _, fs in writers for f in fs]
            finalize_hf_checkpoint(out_dir, files, model_cfg, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
    box = [errors]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0]:
        raise RuntimeError(f"writing the HF checkpoint {out_dir} failed: " + "; ".join(box[0]))
