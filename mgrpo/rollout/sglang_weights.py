"""Weights into SGLang servers: payload serialisation, the weight-update session, and the two
trainer-side senders (same duck type as `EngineReceiver`: `update_weights(bucket)`).

What SGLang expects (read in sglang 0.5.23; file names are under `sglang/srt/`):
- Every `update_weights_from_tensor` / `update_weights_from_distributed` must run inside a
  weight-update session: `POST /begin_weight_update {"selector": "all"}` first and
  `POST /end_weight_update {}` after the last bucket (managers/scheduler_components/weight_updater.py
  refuses the update otherwise). `begin` on an open session fails with "already open".
- `/update_weights_from_tensor` (io_struct.UpdateWeightsFromTensorReqInput):
  `serialized_named_tensors` is a list with ONE base64 payload PER ENGINE TP RANK; rank r
  deserialises entry r only (managers/tp_worker.py::deserialize_own_rank), with
  `MultiprocessingSerializer.deserialize` = ForkingPickler bytes read by a `SafeUnpickler` that
  only admits an allow-list of globals (utils/common.py). Each rank must get its own
  serialisation so CUDA-IPC reference counts drop per consumer (entrypoints/engine.py::
  _serialize_tensors_per_rank). With `load_format="flattened_bucket"` the payload is
  `{"flattened_tensor": uint8 tensor, "metadata": [obj with name, shape, dtype, start_idx,
  end_idx, numel]}` (model_runner_components/weight_updater.py::_update_weights_from_flattened_bucket
  reads only those attributes, so `types.SimpleNamespace` - allow-listed - carries them without
  importing sglang in the trainer); with `load_format=None` it is `[(name, tensor), ...]`.
- CUDA tensors travel as IPC handles. SGLang's receiver maps a device given as a GPU UUID string
  to its own index (utils/patch_torch.py::_device_from_maybe_uuid), which is what makes handles from
  a trainer process with a different CUDA_VISIBLE_DEVICES usable: we put the UUID in.
- `/init_weights_update_group` (master_address, master_port, rank_offset, world_size, group_name,
  backend): engine TP rank t joins as rank `rank_offset + t` of a group made by
  utils/common.py::init_custom_process_group (tcp rendezvous, PrefixStore(group_name),
  `_new_process_group_helper`); the trainer is rank 0 and hosts the TCPStore.
- `/update_weights_from_distributed` (names, dtypes as torch attribute names like "bfloat16",
  shapes, group_name, flush_cache, load_format, weight_version): with `flattened_bucket` the engine
  receives ONE uint8 broadcast from rank 0 laid out back to back in the given order, rejecting
  offsets not aligned to the dtype (weight_sync/tensor_bucket.py::FlattenedTensorBucket.empty);
  otherwise one broadcast per tensor, in order. The POST returns only after the broadcast.
"""

from __future__ import annotations

import base64
import copyreg
import io
import os
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from mgrpo.rollout.sglang_http import (HTTPClient, SGLangRequestError, SGLangUnavailableError, node_ip,
                                      require_cuda)

Bucket = Sequence[tuple[str, torch.Tensor]]

FLATTENED = "flattened_bucket"

# Globals our payloads may contain; each is in SGLang's SafeUnpickler.ALLOWED_GLOBALS
# (utils/common.py). tests/test_sglang_weights.py checks both statements.
PAYLOAD_GLOBALS = frozenset({
    ("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("multiprocessing.resource_sharer", "DupFd"),
}) | frozenset(("torch", str(d).removeprefix("torch.")) for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2))


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with getattr(torch, name): 'bfloat16', not 'torch.bfloat16'."""
    return str(dtype).removeprefix("torch.")


# --- serialisation --------------------------------------------------------------------------------
def _reduce_tensor_with_uuid(tensor: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(tensor)
    # rebuild_cuda_tensor's 7th argument is the storage's device index in *this* process; the
    # engine's CUDA_VISIBLE_DEVICES differs, so name the GPU by UUID (SGLang's receiver resolves it).
    if tensor.is_cuda and len(args) > 6 and isinstance(args[6], int):
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args


def _pickler(buf: io.BytesIO):
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)
    from multiprocessing.reduction import ForkingPickler

    p = ForkingPickler(buf)
    table = copyreg.dispatch_table.copy()
    table.update(ForkingPickler._extra_reducers)
    table[torch.Tensor] = _reduce_tensor_with_uuid
    table[torch.nn.Parameter] = _reduce_tensor_with_uuid
    p.dispatch_table = table
    return p


def serialize(obj: Any) -> str:
    """ForkingPickler bytes (tensors by handle, not by value) as base64 text, the form
    `serialized_named_tensors` takes over HTTP."""
    buf = io.BytesIO()
    _pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flatten_bucket(bucket: Bucket) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 buffer holding the bucket back to back, plus per-tensor metadata.

    Larger element sizes come first so that every tensor starts at a multiple of its element size
    (SGLang views the byte slices back as the dtype, which needs aligned offsets)."""
    if not bucket:
        raise ValueError("weight sync: empty bucket")
    order = sorted(range(len(bucket)), key=lambda i: -bucket[i][1].element_size())
    parts, meta, offset = [], [], 0
    for i in order:
        name, t = bucket[i]
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        meta.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=offset,
                                          end_idx=offset + flat.numel(), numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), meta


def tensor_payloads(bucket: Bucket, tp_size: int, load_format: Optional[str] = FLATTENED) -> tuple[list[str], Any]:
    """`serialized_named_tensors` for an engine of `tp_size` ranks, and the object that must stay
    alive until the engine has answered (it owns the memory the handles point at)."""
    if load_format == FLATTENED:
        flat, meta = flatten_bucket(bucket)
        obj: Any = {"flattened_tensor": flat, "metadata": meta}
    elif load_format is None:
        obj = [(name, t.detach()) for name, t in bucket]
    else:
        raise ValueError(f"load_format must be {FLATTENED!r} or None, got {load_format!r}")
    return [serialize(obj) for _ in range(tp_size)], obj


# --- the weight-update session --------------------------------------------------------------------
class WeightSession:
    """The control calls around one weight sync on one engine (see the module docstring)."""

    def __init__(self, client: HTTPClient):
        self.client = client
        self._lock = threading.Lock()
        self.open = False

    def __getstate__(self):
        return {"client": self.client, "open": False}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def begin(self, force: bool = False) -> None:
        """Open the session unless this object opened it already (`force`: ask the server anyway,
        for senders whose session someone else closes); another sender having opened it is fine."""
        with self._lock:
            if self.open and not force:
                return
            try:
                self.client.post_result("/begin_weight_update", {"selector": "all"})
            except SGLangRequestError as e:
                if "already open" not in str(e):
                    raise
            self.open = True

    def end(self) -> bool:
        """Close the session; False when none was open (no bucket reached the engine)."""
        with self._lock:
            self.open = False
            try:
                self.client.post_result("/end_weight_update", {})
            except SGLangRequestError as e:
                if "no weight-update session is open" in str(e):
                    return False
                raise
            return True

    def set_version(self, version: int) -> None:
        # abort_all_requests defaults to True in SGLang: never abort rollouts to bump a label.
        self.client.post_result("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def flush_cache(self) -> None:
        # 400 when requests are still running: a stale prefix cache would feed old-weight KV to new rollouts.
        self.client.post("/flush_cache", {})


def _check_bucket(bucket: Bucket) -> None:
    if not bucket:
        raise ValueError("weight sync: empty bucket")
    for name, t in bucket:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight sync: {name} is a {type(t).__name__}, not a tensor")


# --- colocated: CUDA IPC ----------------------------------------------------------------------------
class IPCWeightSender:
    """Colocated mode: a trainer rank holding HF-layout CUDA tensors posts their IPC handles to the
    engines on its node (`POST /update_weights_from_tensor`); the engines copy from the trainer's
    memory. CUDA IPC is intra-node: every URL must be a server on this rank's node.

    After all buckets, the driver calls `finish_weight_update(version)` on every engine, which
    closes the session, sets the version and flushes the cache."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int] | int = 1, *, load_format: Optional[str] = FLATTENED,
                 timeout_s: float = 600.0, max_retries: int = 2, allow_cpu: bool = False):
        self.clients = [HTTPClient(u, timeout_s=timeout_s, max_retries=max_retries) for u in urls]
        self.tp_sizes = [tp_sizes] * len(urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(urls)} engine URLs but {len(self.tp_sizes)} TP sizes")
        self.sessions = [WeightSession(c) for c in self.clients]
        self.load_format = load_format
        self.allow_cpu = allow_cpu
        """CPU tensors travel as shared-memory file descriptors, which only a process of the same
        family can open: tests (a server thread in this process) only."""
        self.bytes_sent = 0

    def update_weights(self, bucket: Bucket) -> None:
        _check_bucket(bucket)
        if not self.allow_cpu:
            require_cuda("IPCWeightSender (colocated weight sync over CUDA IPC)")
            cpu = [n for n, t in bucket if not t.is_cuda]
            if cpu:
                raise ValueError(f"IPCWeightSender sends CUDA tensors by handle; {len(cpu)} are on the CPU, "
                                 f"e.g. {cpu[:3]} (rollout.mode=colocated needs the trainer's bucket on GPU)")
        for client, session, tp in zip(self.clients, self.sessions, self.tp_sizes):
            session.begin(force=True)  # the driver's finish_weight_update closes it between syncs
            payloads, keep_alive = tensor_payloads(bucket, tp, self.load_format)
            client.post_result("/update_weights_from_tensor", {
                "serialized_named_tensors": payloads, "load_format": self.load_format,
                "flush_cache": False, "abort_all_requests": False})
            del keep_alive  # the engine has copied: the trainer's buffer may go
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t in bucket)


# --- disaggregated: NCCL broadcast --------------------------------------------------------------------
def new_weight_update_group(master_address: str, master_port: int, world_size: int, group_name: str, *,
                            backend: str = "nccl", rank: int = 0, timeout_s: float = 600.0):
    """A process group outside the default one, made the way SGLang makes its side
    (utils/common.py::init_custom_process_group): tcp rendezvous (rank 0 hosts the TCPStore),
    a PrefixStore named after the group, `_new_process_group_helper`, identity rank map."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def free_port(host: str = "") -> int:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LIVE_SENDERS: dict[str, "DistributedWeightSender"] = {}


def _live_sender(key: str, spec: dict) -> "DistributedWeightSender":
    """Unpickling a sender in a process that already holds one for the same spec returns that one:
    the process group is made once per trainer process, not once per sync."""
    sender = _LIVE_SENDERS.get(key)
    if sender is None:
        sender = _LIVE_SENDERS[key] = DistributedWeightSender(**spec, _key=key)
    return sender


class DistributedWeightSender:
    """Disaggregated mode: the trainer's source rank (one per pipeline stage) broadcasts each bucket
    over a process group it shares with every engine TP rank. World size = 1 + sum of engine TP
    sizes; the trainer is rank 0, engine i's ranks start at 1 + (TP sizes of engines before i).

    Made on the driver and shipped to the trainer ranks (it pickles as its spec; a rank keeps one
    live sender per spec). Resolved on the rank that first sends: `master_address` (this node's
    address), `master_port` (a free one), `group_name` (per global rank, so pipeline stages get
    their own groups). Several stages must not interleave their buckets: an engine serves one
    update at a time, so two stages reaching two engines in opposite orders would deadlock; pass
    one shared `lock` (a picklable context manager) to serialise them."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int] | int, *, master_address: Optional[str] = None,
                 master_port: Optional[int] = None, group_name: Optional[str] = None, backend: str = "nccl",
                 load_format: Optional[str] = FLATTENED, timeout_s: float = 600.0, device: Optional[str] = None,
                 lock=None, _key: Optional[str] = None):
        if master_address is not None and master_address.strip() in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"master_address must be this node's cluster address, got {master_address!r}")
        self._spec = dict(urls=list(urls), tp_sizes=tp_sizes, master_address=master_address, master_port=master_port,
                          group_name=group_name, backend=backend, load_format=load_format, timeout_s=timeout_s,
                          device=device, lock=lock)
        import uuid

        self._key = _key or uuid.uuid4().hex
        _LIVE_SENDERS.setdefault(self._key, self)
        self.clients = [HTTPClient(u, timeout_s=timeout_s, max_retries=0) for u in urls]
        self.tp_sizes = [tp_sizes] * len(urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(urls)} engine URLs but {len(self.tp_sizes)} TP sizes")
        self.sessions = [WeightSession(c) for c in self.clients]
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.load_format = load_format
        self.timeout_s = timeout_s
        self.device = device
        self.lock = lock if lock is not None else nullcontext()
        self.group = None
        self.broken = False
        self.bytes_sent = 0
        self._pool_: Optional[ThreadPoolExecutor] = None

    def __reduce__(self):
        return _live_sender, (self._key, self._spec)

    @property
    def _pool(self) -> ThreadPoolExecutor:
        if self._pool_ is None:
            self._pool_ = ThreadPoolExecutor(max_workers=max(1, len(self.clients)), thread_name_prefix="mgrpo-wsync")
        return self._pool_

    @property
    def world_size(self) -> int:
        return 1 + sum(self.tp_sizes)

    def _check_capability(self) -> None:
        if self.backend == "nccl":
            require_cuda("DistributedWeightSender (NCCL weight broadcast to rollout engines)")
            if not torch.distributed.is_nccl_available():
                raise SGLangUnavailableError("DistributedWeightSender: this torch build has no NCCL "
                                             "(rollout.mode=disaggregated with rollout.engine=sglang needs it)")

    def _target_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def connect(self) -> None:
        """Every engine joins the group (its POST returns once the rendezvous completes) while this
        rank joins as rank 0."""
        if self.group is not None:
            return
        self._check_capability()
        import torch.distributed as dist

        if self.master_address is None:
            self.master_address = node_ip()
        if self.master_port is None:
            self.master_port = free_port(self.master_address)
        if self.group_name is None:
            who = f"rank{dist.get_rank()}" if dist.is_initialized() else f"pid{os.getpid()}"
            self.group_name = f"mgrpo-weights-{who}"
        offsets, acc = [], 1
        for tp in self.tp_sizes:
            offsets.append(acc)
            acc += tp
        futures = [self._pool.submit(c.post_result, "/init_weights_update_group", {
            "master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
            "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend})
            for c, off in zip(self.clients, offsets)]
        try:
            self.group = new_weight_update_group(self.master_address, self.master_port, self.world_size,
                                                 self.group_name, backend=self.backend, timeout_s=self.timeout_s)
        finally:
            errors = [_error_of(f) for f in futures]
        errors = [e for e in errors if e]
        if errors:
            self.broken = True
            raise SGLangRequestError(f"init_weights_update_group {self.group_name!r} failed: " + "; ".join(errors))

    def update_weights(self, bucket: Bucket) -> None:
        _check_bucket(bucket)
        if self.broken:
            raise RuntimeError(f"DistributedWeightSender {self.group_name!r} is unusable after a failed broadcast; "
                               "make a new one with a new group_name (and restart the engines' side)")
        self.connect()
        device = self._target_device()
        with self.lock:
            for s in self.sessions:
                s.begin(force=True)  # the driver's finish_weight_update closes it between syncs
            if self.load_format == FLATTENED:
                flat, meta = flatten_bucket([(n, t.to(device, non_blocking=True)) for n, t in bucket])
                names, dtypes, shapes = ([m.name for m in meta], [dtype_name(m.dtype) for m in meta],
                                         [list(m.shape) for m in meta])
                sends = [flat]
            else:
                names, sends = [n for n, _ in bucket], [t.to(device, non_blocking=True).contiguous() for _, t in bucket]
                dtypes, shapes = [dtype_name(t.dtype) for t in sends], [list(t.shape) for t in sends]
            body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                    "flush_cache": False, "abort_all_requests": False, "load_format": self.load_format}
            futures = [self._pool.submit(c.post_result, "/update_weights_from_distributed", body) for c in self.clients]
            # A POST answers only after the broadcast: one that is already back has failed, and
            # broadcasting then would wait for a receiver that never comes.
            early = [_error_of(f) for f in futures if f.done()]
            if any(early):
                self.broken = True  # engines that did accept now wait for a broadcast that will not come
                raise SGLangRequestError("update_weights_from_distributed refused before the broadcast: "
                                         + "; ".join(e for e in early if e))
            import torch.distributed as dist

            works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for t in sends]
            self._wait(works, futures)
            errors = [e for e in (_error_of(f) for f in futures) if e]
        if errors:
            raise SGLangRequestError(f"update_weights_from_distributed ({len(names)} tensors) failed: "
                                     + "; ".join(errors))
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t in bucket)

    def _wait(self, works, futures) -> None:
        """Wait for the broadcasts, but stop as soon as an engine has answered with an error: its
        side will never receive, and waiting would last the whole group timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not all(w.is_completed() for w in works):
            failed = [e for e in (_error_of(f) for f in futures if f.done()) if e]
            if failed or time.monotonic() > deadline:
                self.broken = True
                raise SGLangRequestError(f"weight broadcast on {self.group_name!r} abandoned: "
                                         + ("; ".join(failed) if failed else f"timeout_s={self.timeout_s} passed"))
            time.sleep(0.005)
        for w in works:
            w.wait()

    def close(self) -> None:
        """Destroy the group on the engines and here."""
        if self.group is None:
            return
        import torch.distributed as dist

        futures = [self._pool.submit(c.post_result, "/destroy_weights_update_group", {"group_name": self.group_name})
                   for c in self.clients]
        dist.destroy_process_group(self.group)
        self.group = None
        for f in futures:
            _error_of(f)  # best effort: an engine that is gone has no group left to destroy
        self._pool.shutdown(wait=False)
        self._pool_ = None
        _LIVE_SENDERS.pop(self._key, None)


def _error_of(future) -> Optional[str]:
    try:
        future.result()
        return None
    except Exception as e:  # noqa: BLE001 - reported to the caller with the engine's message
        return str(e)
