"""Weight buckets as SGLang lays them out: one flattened uint8 buffer plus per-tensor metadata.

Shared by both senders (tensor and distributed transports) and by the CPU server, which reads
them back exactly as SGLang does (sglang 0.5.23, `srt/weight_sync/tensor_bucket.py` and
`srt/model_executor/.../weight_updater.py::_update_weights_from_flattened_bucket`).
"""

from __future__ import annotations

import types
from typing import Optional, Sequence

import torch

Bucket = Sequence[tuple[str, torch.Tensor]]

FLATTENED = "flattened_bucket"
LOAD_FORMATS = (FLATTENED, None)


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with getattr(torch, name): 'bfloat16', not 'torch.bfloat16'."""
    return str(dtype).removeprefix("torch.")


def check_bucket(bucket: Bucket) -> None:
    if not bucket:
        raise ValueError("weight sync: empty bucket")
    for name, t in bucket:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: {name} is a {type(t).__name__}, not a tensor")


def check_load_format(load_format: Optional[str]) -> Optional[str]:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be {FLATTENED!r} or None, got {load_format!r}")
    return load_format


def bucket_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def flat_layout(bucket: Bucket) -> tuple[list[int], list[types.SimpleNamespace], int]:
    """Order and metadata of the flattened buffer. Larger element sizes come first so that every
    tensor starts at a multiple of its element size (SGLang views the byte slices back as the
    dtype, which needs aligned offsets)."""
    order = sorted(range(len(bucket)), key=lambda i: -bucket[i][1].element_size())
    meta, offset = [], 0
    for i in order:
        name, t = bucket[i]
        n = t.numel() * t.element_size()
        meta.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=offset,
                                          end_idx=offset + n, numel=n))
        offset += n
    return order, meta, offset


def flatten_bucket(bucket: Bucket,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 buffer holding the bucket back to back (into `out` when given: e.g. a buffer in
    shared memory, so that the bytes are copied once), plus per-tensor metadata."""
    check_bucket(bucket)
    order, meta, total = flat_layout(bucket)
    device = bucket[order[0]][1].device
    flat = torch.empty(total, dtype=torch.uint8, device=device) if out is None else out
    if flat.numel() != total or flat.dtype != torch.uint8:
        raise ValueError(f"flatten_bucket: out buffer has {flat.numel()} {flat.dtype} elements, "
                         f"the bucket needs {total} uint8")
    for i, m in zip(order, meta):
        flat[m.start_idx:m.end_idx].copy_(bucket[i][1].detach().contiguous().view(-1).view(torch.uint8))
    return flat, meta


def unflatten(flat: torch.Tensor, metadata) -> list[tuple[str, torch.Tensor]]:
    """The named views of a flattened buffer (what SGLang's receiver does with one)."""
    out = []
    for m in metadata:
        if m.start_idx % m.dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {m.name}: byte offset {m.start_idx}, dtype {m.dtype}")
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


def distributed_layout(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]):
    """The receiver's side of a flattened broadcast (`FlattenedTensorBucket.empty`): byte ranges in
    the given order, refusing offsets not aligned to the dtype."""
    metas, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        if offset % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
        size = torch.Size(shape).numel() * dt.itemsize
        metas.append(types.SimpleNamespace(name=name, dtype=dt, shape=torch.Size(shape), start_idx=offset,
                                           end_idx=offset + size, numel=size))
        offset += size
    return metas, offset
