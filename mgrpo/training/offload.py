"""Host memory for a rank's tensors while rollout engines on the same accelerators generate (actor.offload).

A tensor's memory is its storage: megatron's DDP keeps every parameter as a view into one flat buffer per
dtype (and every gradient in another), so releasing the storage releases every view at once, and resizing it
back restores them all in place, at the same addresses the optimizer, the hooks and the views already hold.
Offloading a storage copies its bytes into a host buffer (pinned on CUDA, reused from step to step: pinning
is slow), waits for the copy and resizes the storage to 0 bytes; restoring resizes it back and copies the
bytes in. The same code runs on CPU ranks (host buffers unpinned, the storage really released), so the tests
that compare a run with offload to one without exercise exactly this path.

What is frozen (the reference) is copied out once: afterwards offloading it only releases its storage. What
is overwritten before it is read (the gradient buffers, zeroed at the start of every update) is released
without a copy and comes back zeroed. Seconds and bytes copied are counted until `take` hands them over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch


def unique_storages(tensors: Iterable[torch.Tensor], skip: set[int] = frozenset()) -> list:
    """The distinct non-empty storages behind `tensors`, in first-seen order, except those whose data pointer
    is in `skip` (the storage of a view and of its base are one)."""
    seen, out = set(skip), []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        out.append(s)
    return out


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Out:
    storages: list
    sizes: list[int]
    copied: bool
    """The bytes are in host buffers (else the storages come back zeroed)."""


@dataclass
class HostOffload:
    """Named groups of storages moved to host memory and back; `take` returns the seconds and bytes."""

    pinned: bool
    """Pinned host buffers (CUDA): asynchronous copies at full bus speed."""
    host: dict = field(default_factory=dict)
    """group name -> host buffers (kept: reused next step, and a frozen group's copy stays valid)."""
    out: dict = field(default_factory=dict)
    """group name -> _Out while offloaded."""
    seconds: float = 0.0
    bytes: int = 0

    def offloaded(self, name: str) -> bool:
        return name in self.out

    def offload(self, name: str, storages: list, *, copy: bool = True, frozen: bool = False) -> None:
        """Release `storages` (their bytes first copied to host unless `copy` is False). `frozen`: the bytes
        never change, so a host copy made before is still good and is not made again."""
        if name in self.out:
            return
        t0 = time.perf_counter()
        sizes = [s.nbytes() for s in storages]
        if copy:
            bufs = self.host.get(name)
            fresh = bufs is None or [b.numel() for b in bufs] != sizes
            if fresh:
                bufs = [torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned) for n in sizes]
                self.host[name] = bufs
            if fresh or not frozen:
                for s, b in zip(storages, bufs):
                    b.copy_(_bytes_of(s), non_blocking=self.pinned)
                    self.bytes += b.numel()
                self._wait(storages)
        for s in storages:
            s.resize_(0)
        self.out[name] = _Out(storages, sizes, copy)
        self._free(storages)
        self.seconds += time.perf_counter() - t0

    def restore(self, name: str) -> None:
        """Give `name`'s storages their bytes back (or zeros, for a group released without a copy)."""
        got = self.out.pop(name, None)
        if got is None:
            return
        t0 = time.perf_counter()
        for i, (s, n) in enumerate(zip(got.storages, got.sizes)):
            s.resize_(n)
            if got.copied:
                _bytes_of(s).copy_(self.host[name][i], non_blocking=self.pinned)
                self.bytes += n
            else:
                _bytes_of(s).zero_()
        self._wait(got.storages)
        self.seconds += time.perf_counter() - t0

    def take(self) -> dict:
        """The seconds and bytes copied since the last `take`."""
        out = {"perf/offload_s": self.seconds, "perf/offload_bytes": float(self.bytes)}
        self.seconds, self.bytes = 0.0, 0
        return out

    @staticmethod
    def _wait(storages: list) -> None:
        if storages and storages[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    @staticmethod
    def _free(storages: list) -> None:
        """Hand released device memory back to the driver, where another process's engine can take it (the
        caching allocator would otherwise keep it for this process)."""
        if storages and storages[0].device.type == "cuda":
            torch.cuda.empty_cache()

    def held(self) -> dict:
        """Each offloaded group now: {'released': bytes it held, 'resident': bytes its storages hold now (0)}."""
        return {name: {"released": sum(got.sizes), "resident": sum(s.nbytes() for s in got.storages)}
                for name, got in self.out.items()}


def grad_storages(ddp, gpt) -> list:
    """The DDP gradient buffers (every main_grad is a view into one) and any other .grad."""
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    tensors = [b.grad_data for b in buffers] + [p.grad for p in gpt.parameters() if p.grad is not None]
    return unique_storages(tensors, skip={s.data_ptr() for s in unique_storages(gpt.parameters())})


def optimizer_storages(optimizer, ddp, gpt) -> list:
    """The torch optimizers' states and their own parameters where those are not the model's (the fp32 master
    weights of a bf16 actor)."""
    from mgrpo.training.optim import torch_optimizers

    tensors = []
    for opt in torch_optimizers(optimizer):
        tensors += [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    skip = {s.data_ptr() for s in unique_storages(gpt.parameters()) + grad_storages(ddp, gpt)}
    return unique_storages(tensors, skip=skip)
