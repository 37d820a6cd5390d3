"""Colocated weight sync: `POST /update_weights_from_tensor` with tensors passed by handle.

What SGLang expects (sglang 0.5.23; files under `sglang/srt/`):
- `serialized_named_tensors` (io_struct.UpdateWeightsFromTensorReqInput) is a list with ONE base64
  payload PER ENGINE TP RANK; rank r deserialises entry r only (managers/tp_worker.py::
  deserialize_own_rank) with `MultiprocessingSerializer.deserialize`: ForkingPickler bytes read by
  a `SafeUnpickler` that admits an allow-list of globals (utils/common.py). Each rank gets its own
  serialisation so that handle reference counts drop per consumer
  (entrypoints/engine.py::_serialize_tensors_per_rank).
- With `load_format="flattened_bucket"` the payload is `{"flattened_tensor": uint8 tensor,
  "metadata": [obj with name, shape, dtype, start_idx, end_idx, numel]}` (the receiver reads only
  those attributes, so `types.SimpleNamespace`, allow-listed, carries them without importing
  sglang here); with `load_format=None` it is `[(name, tensor), ...]`.

How the tensors travel:
- CUDA tensors: CUDA IPC handles (torch's `rebuild_cuda_tensor`). SGLang's receiver maps a device
  given as a GPU UUID string to its own index (utils/patch_torch.py::_device_from_maybe_uuid),
  which makes handles from a trainer with a different CUDA_VISIBLE_DEVICES usable: we put it in.
- CPU tensors: POSIX shared memory *by name* (torch's `rebuild_storage_filename`, i.e. the
  `file_system` sharing strategy), whatever the process's global sharing strategy. torch's default
  on Linux (`file_descriptor`) sends a file descriptor through multiprocessing's resource sharer,
  which only a process of the same multiprocessing family (same authkey) can fetch; the rollout
  server is an unrelated process, so it could not open those. A name can be opened by any process
  of the same user on the node, like a CUDA IPC handle. Each serialisation increments the
  segment's shared reference count and each deserialisation decrements it, so a segment lives
  until the sender and every TP rank have dropped it; the bucket is written straight into a fresh
  named segment (one copy) and never moves the trainer's own parameters into shared memory.
"""

from __future__ import annotations

import base64
import copyreg
import io
from typing import Any, Optional, Sequence

import torch

from mgrpo.rollout.sglang.protocol.buckets import (FLATTENED, Bucket, bucket_bytes, check_bucket,
                                                   check_load_format, flat_layout, flatten_bucket)
from mgrpo.rollout.sglang.http import HTTPClient
from mgrpo.rollout.sglang.session import WeightSession


# --- serialisation --------------------------------------------------------------------------------
def _reduce_tensor_with_uuid(tensor: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(tensor)
    # rebuild_cuda_tensor's 7th argument is the storage's device index in *this* process; the
    # engine's CUDA_VISIBLE_DEVICES differs, so name the GPU by UUID (SGLang's receiver resolves it).
    if tensor.is_cuda and len(args) > 6 and isinstance(args[6], int):
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args


def _reduce_cpu_storage_by_name(storage: torch.UntypedStorage):
    """torch's reduce_storage under the file_system strategy, without changing the global strategy."""
    from torch.multiprocessing import reductions

    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)  # raises torch's own error for CUDA/meta storages
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    metadata = storage._share_filename_cpu_()  # (manager socket, segment name, size); no copy when named already
    storage._shared_incref()  # the receiver's rebuild_storage_filename drops this reference
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage),) + tuple(metadata)


def _pickler(buf: io.BytesIO):
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)
    from multiprocessing.reduction import ForkingPickler

    p = ForkingPickler(buf)
    table = copyreg.dispatch_table.copy()
    table.update(ForkingPickler._extra_reducers)
    table[torch.Tensor] = _reduce_tensor_with_uuid
    table[torch.nn.Parameter] = _reduce_tensor_with_uuid
    table[torch.UntypedStorage] = _reduce_cpu_storage_by_name
    p.dispatch_table = table
    return p


def serialize(obj: Any) -> str:
    """ForkingPickler bytes (tensors by handle, not by value) as base64 text, the form
    `serialized_named_tensors` takes over HTTP."""
    buf = io.BytesIO()
    _pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor whose storage is a named shared-memory segment."""
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    out = shared_cpu_buffer(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    return out.copy_(t)


def payload_object(bucket: Bucket, load_format: Optional[str] = FLATTENED,
                   staging: Optional[torch.Tensor] = None) -> Any:
    """What one TP rank deserialises; it owns the memory the handles point at, so it must stay
    alive until every engine it was posted to has answered. `staging`: a shared uint8 buffer to
    flatten CPU buckets into (reused across buckets: no new segment, no page faults per bucket)."""
    check_bucket(bucket)
    check_load_format(load_format)
    if load_format == FLATTENED:
        on_cpu = all(t.device.type == "cpu" for _, t in bucket)
        nbytes = flat_layout(bucket)[2]
        out = None
        if on_cpu:
            out = staging[:nbytes] if staging is not None and staging.numel() >= nbytes else shared_cpu_buffer(nbytes)
        flat, meta = flatten_bucket(bucket, out=out)
        return {"flattened_tensor": flat, "metadata": meta}
    return [(name, _shared_copy(t) if t.device.type == "cpu" else t.detach()) for name, t in bucket]


def staging_buffer(current: Optional[torch.Tensor], bucket: Bucket,
                   load_format: Optional[str]) -> Optional[torch.Tensor]:
    """One named shared-memory buffer per sender, grown to the largest CPU bucket and reused: every
    POST has returned (the engines copied out of it) before the next bucket is written. Unchanged
    when the bucket does not go flattened from the CPU."""
    if load_format != FLATTENED or not all(t.device.type == "cpu" for _, t in bucket):
        return current
    nbytes = flat_layout(bucket)[2]
    if current is None or current.numel() < nbytes:
        current = None  # drop the smaller one first
        current = shared_cpu_buffer(nbytes)
    return current


def tensor_payloads(bucket: Bucket, tp_size: int, load_format: Optional[str] = FLATTENED) -> tuple[list[str], Any]:
    """`serialized_named_tensors` for an engine of `tp_size` ranks, and the object to keep alive."""
    obj = payload_object(bucket, load_format)
    return [serialize(obj) for _ in range(tp_size)], obj


# --- the colocated sender ---------------------------------------------------------------------------
class TensorWeightSender:
    """Colocated mode: a Megatron rank posts handles to its HF-layout bucket to the engines on its
    node (`POST /update_weights_from_tensor`); the engines copy from the trainer's memory. Handles
    (CUDA IPC or shared-memory names) are intra-node: every URL must be a server on this rank's node.

    After all buckets, the driver calls `finish_weight_update(version)` on every engine, which
    closes the session, sets the version and flushes the cache."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int] | int = 1, *,
                 load_format: Optional[str] = FLATTENED, timeout_s: float = 600.0, max_retries: int = 2,
                 api_key: Optional[str] = None):
        self.clients = [HTTPClient(u, timeout_s=timeout_s, max_retries=max_retries, api_key=api_key) for u in urls]
        self.tp_sizes = [tp_sizes] * len(urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(urls)} engine URLs but {len(self.tp_sizes)} TP sizes")
        self.sessions = [WeightSession(c) for c in self.clients]
        self.load_format = check_load_format(load_format)
        self.bytes_sent = 0
        self.buckets_sent = 0
        self._staging: Optional[torch.Tensor] = None

    def __getstate__(self):  # travels to Megatron ranks pickled: the staging buffer stays behind
        return {**self.__dict__, "_staging": None}

    def update_weights(self, bucket: Bucket) -> None:
        self._staging = staging_buffer(self._staging, bucket, self.load_format)
        keep_alive = payload_object(bucket, self.load_format, self._staging)  # flattened once for all engines
        for client, session, tp in zip(self.clients, self.sessions, self.tp_sizes):
            session.begin(force=True)  # the driver's finish_weight_update closes it between syncs
            client.post_result("/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize(keep_alive) for _ in range(tp)],
                "load_format": self.load_format, "flush_cache": False, "abort_all_requests": False})
        del keep_alive  # every engine has copied: the buffer may go
        self.bytes_sent += bucket_bytes(bucket)
        self.buckets_sent += 1


IPCWeightSender = TensorWeightSender
"""The name before CPU tensors could travel too (CUDA IPC only)."""
