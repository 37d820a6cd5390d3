"""Disaggregated weight sync: a process group between the trainer's source rank and the engines.

What SGLang expects (sglang 0.5.23; files under `sglang/srt/`):
- `/init_weights_update_group` (master_address, master_port, rank_offset, world_size, group_name,
  backend): engine TP rank t joins as rank `rank_offset + t` of a group made by
  utils/common.py::init_custom_process_group (tcp rendezvous, PrefixStore(group_name),
  `_new_process_group_helper`); the trainer is rank 0 and hosts the TCPStore.
- `/update_weights_from_distributed` (names, dtypes as torch attribute names like "bfloat16",
  shapes, group_name, flush_cache, load_format, ...): with `flattened_bucket` the engine receives
  ONE uint8 broadcast from rank 0 laid out back to back in the given order, rejecting offsets not
  aligned to the dtype (weight_sync/tensor_bucket.py::FlattenedTensorBucket.empty); otherwise one
  broadcast per tensor, in order. The POST returns only after the broadcast.
- `/destroy_weights_update_group` (group_name).

Backend by capability: NCCL where CUDA is, gloo otherwise (the CPU server joins over gloo).

Group lifetime: torch.distributed refuses a second group under a name still in use, so
a group is made once per sender and reused for every sync. A sender pickles as its spec and
resolves, in each process, to the one live sender with that spec: the driver may ship the same
sender every sync (or even rebuild an identical one) and the Megatron rank keeps its group. After
an engine restart the driver makes a new sender (new URLs, or `generation=` bumped when a URL is
reused); on its first use the rank closes the other live sender (a process holds one group at a
time: the old group is destroyed on the surviving engines and locally) and makes a new group
under a new name (`mgrpo-weights-rank{N}-g{k}`, k counting groups made by this process).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from mgrpo.net import free_port, node_ip
from mgrpo.rollout.sglang.http import HTTPClient, SGLangRequestError, SGLangUnavailableError, require_cuda
from mgrpo.rollout.sglang.protocol.buckets import (FLATTENED, Bucket, bucket_bytes, check_bucket, check_load_format,
                                                   dtype_name, flat_layout, flatten_bucket)
from mgrpo.rollout.sglang.protocol.group import new_weight_update_group
from mgrpo.rollout.sglang.session import WeightSession

log = logging.getLogger(__name__)
BACKENDS = ("nccl", "gloo")


def default_backend() -> str:
    """NCCL when this process sees CUDA and torch has NCCL, gloo otherwise."""
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


_LIVE_SENDERS: dict[str, "DistributedWeightSender"] = {}
_GROUPS_MADE = itertools.count()  # per process: every group this process makes gets a new name


def _live_sender(key: str, spec: dict) -> "DistributedWeightSender":
    """Unpickling a sender in a process that already holds one with the same spec returns that one."""
    sender = _LIVE_SENDERS.get(key)
    if sender is None:
        sender = DistributedWeightSender(**spec)
    return sender


def _spec_key(spec: dict) -> str:
    keyed = {k: v for k, v in spec.items() if k != "lock"}
    return hashlib.sha1(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()


class DistributedWeightSender:
    """Disaggregated mode: the trainer's source rank (one per pipeline stage) broadcasts each bucket
    over a process group it shares with every engine TP rank. World size = 1 + sum of engine TP
    sizes; the trainer is rank 0, engine i's ranks start at 1 + (TP sizes of engines before i).

    Made on the driver, shipped to the Megatron ranks, reused for every sync (module docstring).
    Resolved on the rank that first sends: `backend` (None: NCCL with CUDA, else gloo),
    `master_address` (this node's address), `master_port` (a free one), `group_name` (None: per
    global rank and group count, so pipeline stages and successive groups get their own). Several
    stages must not interleave their buckets: an engine serves one update at a time, so two stages
    reaching two engines in opposite orders would deadlock; pass one shared `lock` (a picklable
    context manager) to serialise them. `generation`: bump it to force a new group (e.g. after an
    engine restart at the same URL)."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int] | int, *, master_address: Optional[str] = None,
                 master_port: Optional[int] = None, group_name: Optional[str] = None, backend: Optional[str] = None,
                 load_format: Optional[str] = FLATTENED, timeout_s: float = 600.0, device: Optional[str] = None,
                 lock=None, generation: int = 0, api_key: Optional[str] = None):
        if master_address is not None and master_address.strip() in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"master_address must be this node's cluster address, got {master_address!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None (by capability), got {backend!r}")
        tps = [tp_sizes] * len(urls) if isinstance(tp_sizes, int) else list(tp_sizes)
        if len(tps) != len(urls):
            raise ValueError(f"{len(urls)} engine URLs but {len(tps)} TP sizes")
        self._spec = dict(urls=list(urls), tp_sizes=tps, master_address=master_address, master_port=master_port,
                          group_name=group_name, backend=backend, load_format=check_load_format(load_format),
                          timeout_s=timeout_s, device=device, lock=lock, generation=generation, api_key=api_key)
        self._key = _spec_key(self._spec)
        _LIVE_SENDERS.setdefault(self._key, self)
        self.urls = list(urls)
        self.clients = [HTTPClient(u, timeout_s=timeout_s, max_retries=0, api_key=api_key) for u in urls]
        self.tp_sizes = tps
        self.sessions = [WeightSession(c) for c in self.clients]
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.load_format = load_format
        self.timeout_s = timeout_s
        self.device = device
        self.generation = generation
        self.lock = lock if lock is not None else nullcontext()
        self.group = None
        self.broken = False
        self.bytes_sent = 0
        self.buckets_sent = 0
        self._pool_: Optional[ThreadPoolExecutor] = None
        self._flat: Optional[torch.Tensor] = None

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
                                             "(rollout.mode=disaggregated over NCCL needs it)")

    def _target_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _supersede(self) -> None:
        """A process holds one weight-update group at a time: the other live senders' groups are
        stale (an engine restarted, the engine set changed) and are destroyed here and on the
        engines that still hold them."""
        for other in list(_LIVE_SENDERS.values()):
            if other is not self and other.group is not None:
                log.info("weight group %r superseded by a new sender; destroying it", other.group_name)
                other.close()

    def connect(self) -> None:
        """Every engine joins the group (its POST returns once the rendezvous completes) while this
        rank joins as rank 0."""
        if self.group is not None:
            return
        if self.backend is None:
            self.backend = default_backend()
        self._check_capability()
        import torch.distributed as dist

        self._supersede()
        _LIVE_SENDERS[self._key] = self
        if self.master_address is None:
            self.master_address = node_ip()
        if self.master_port is None:
            self.master_port = free_port(self.master_address)
        if self.group_name is None:
            who = f"rank{dist.get_rank()}" if dist.is_initialized() else f"pid{os.getpid()}"
            self.group_name = f"mgrpo-weights-{who}-g{next(_GROUPS_MADE)}"
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
        check_bucket(bucket)
        if self.broken:
            raise RuntimeError(f"DistributedWeightSender {self.group_name!r} is unusable after a failed broadcast; "
                               "make a new one (generation+1) after restarting the engines")
        self.connect()
        device = self._target_device()
        with self.lock:
            for s in self.sessions:
                s.begin(force=True)  # the driver's finish_weight_update closes it between syncs
            if self.load_format == FLATTENED:
                moved = [(n, t.to(device, non_blocking=True)) for n, t in bucket]
                flat, meta = flatten_bucket(moved, out=self._flat_buffer(moved, device))
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
        self.bytes_sent += bucket_bytes(bucket)
        self.buckets_sent += 1

    def _flat_buffer(self, bucket: Bucket, device: torch.device) -> Optional[torch.Tensor]:
        """On CPU, one buffer grown to the largest bucket and reused (the broadcast has completed
        before update_weights returns); on GPU a fresh one, not to hold accelerator memory between syncs."""
        if device.type != "cpu":
            return None
        nbytes = flat_layout(bucket)[2]
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = None
            self._flat = torch.empty(nbytes, dtype=torch.uint8)
        return self._flat[:nbytes]

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
        """Destroy the group on the engines (best effort: a restarted engine has none) and here."""
        _LIVE_SENDERS.pop(self._key, None)
        if self.group is None:
            return
        import torch.distributed as dist

        futures = [self._pool.submit(c.post_result, "/destroy_weights_update_group", {"group_name": self.group_name},
                                     timeout_s=30) for c in self.clients]
        dist.destroy_process_group(self.group)
        self.group = None
        for f in futures:
            _error_of(f)
        self._pool.shutdown(wait=False)
        self._pool_ = None


def _error_of(future) -> Optional[str]:
    try:
        future.result()
        return None
    except Exception as e:  # noqa: BLE001 - reported to the caller with the engine's message
        return str(e)
