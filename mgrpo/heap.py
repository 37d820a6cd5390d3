"""The C heap of a process that trains and generates: freed memory goes back to the system between calls.

A Megatron rank (and a hybrid engine inside it) allocates and frees hundreds of MB per call: activations,
the log-prob kernel's chunk of logits, the optimizer's temporaries, one `[rows x vocab]` logits tensor per
decode step. torch's CPU allocator hands these to glibc's malloc, which keeps what is freed: per thread arena
(Ray runs a rank's calls on several threads: its default one, and the `engine` concurrency group's four),
and, below its adaptive mmap threshold (up to 32 MiB: a 16-row decode step's logits at Qwen3's vocabulary
are 9.7 MB), in heaps it trims only at their top. On the qwen3vocab workload (benchmarks/README.md) the
rank's RSS grew by ~400 MB a step and reached 3.6 GiB PSS for ~1.5 GiB of live tensors.

Three measures, all glibc's own:
- `MALLOC_ARENA_MAX=1` in the rank's environment (`ARENA_ENV`, set before the process starts: every process
  of a local Ray inherits it from the raylet, `cluster/ray_env.py::inherited_env`; on a cluster Ray's
  runtime_env sets it): every thread allocates from the one main arena, so what one call frees the next call
  reuses, whichever thread runs it.
- `trim_after_call()` at the end of each call: `malloc_trim(0)`, the free pages inside the heap, not only at
  its top, are returned (madvise), so between calls the rank holds its live tensors and not the last call's
  peak; only once the process's resident memory grew by `CALL_TRIM_MIN_GROWTH` since its last trim. A trim
  walks the heap and the next call faults in again what it returned (`python -m benchmarks.measure.call_trim`,
  load ~12: the trim 0.52 ms; a call of 200 small tensors 1.30 ms, 1.56 ms right after a trim; the tiny job's
  update returned ~65 MiB a step, ~9 ms of trim plus the refaults, until the bound was raised to 128 MiB); the
  tiny job's calls skip it, a step at Qwen3's vocabulary (hundreds of MB per call) still trims every call.
- `trim_before_backward_of(embedding)`: the same trim once the backward reaches the model's input embedding. By
  then the layers' activations are freed but held in the heap, and the embedding's backward allocates a dense
  fp32 [vocab x hidden] gradient (155 MiB at Qwen3's vocabulary and hidden 256) on top of them: the update's
  peak, after the log-prob kernel stopped holding its own dWeight (kernels/chunked.py, grad_weight_into).
- `trim_heap()` every `DECODE_TRIM_EVERY` decode steps of an in-process engine (rollout/hf_engine.py): within
  one `generate` the decode loop's blocks (a `[rows x vocab]` logits block and its softmax every step, a KV
  cache growing by a column) come from the heap once glibc has raised its threshold, small long-lived blocks
  pin the holes, and at 4 prompts x 8 the heap held 1.4 GB more by the call's end (rank_memory.py --trace-ms:
  generate's peak 2,423-2,517 MiB from 981 at its start; trimmed every 16 steps: 1,164-1,720 MiB,
  benchmarks/results/rank_memory_qwen3vocab_p4*.json).
  A fixed `MALLOC_MMAP_THRESHOLD_=4MiB` bounds it as well (1,148-1,630 MiB) but maps and faults in every
  decode step's logits afresh: 6.4x the page faults of glibc's default, against +13% for the trims
  (benchmarks/measure/decode_heap.py), so it is not used.

Elsewhere (musl, macOS) all are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

DECODE_TRIM_EVERY = 16
"""Decode steps between an in-process engine's heap trims: the heap holds at most these steps' holes."""

ARENA_ENV = {"MALLOC_ARENA_MAX": "1"}
"""Environment of a rank's process; a value the user's environment already sets is kept (`arena_env`)."""


def arena_env() -> dict[str, str]:
    return {k: os.environ.get(k, v) for k, v in ARENA_ENV.items()}


CALL_TRIM_MIN_GROWTH = 128 << 20
"""Resident bytes a process may gain since its last trim before `trim_after_call` trims again: what a rank
may hold beyond its live tensors between calls. At 32 MiB the tiny job's rank trimmed once a step: its update
frees ~65 MiB of activations (RSS 540 -> 477 MiB), the trim took ~9 ms of CPU and the next update faulted the
65 MiB in again; the pages are the next call's anyway (the tree's peak is a call's, and it did not move: 906 vs
904 MiB PSS), so at 128 MiB the tiny lockstep step went from 1.22x to 0.88x TRL's and the tree's CPU per step
from 1.30x to 1.03x (one run each, load 5-9). Qwen3-vocabulary calls free hundreds of MB and still trim."""

_resident_after_trim: list = [None]
"""This process's resident bytes right after its last trim (None: not trimmed yet)."""


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux: /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library has no malloc_trim."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def trim_after_call(min_growth: int = CALL_TRIM_MIN_GROWTH) -> bool:
    """`trim_heap()` unless the process's resident memory grew by less than `min_growth` since its last trim
    (freed pages it still holds show there: a call that freed hundreds of MB grows it by as much); True if it
    trimmed. The first call trims."""
    now, last = resident_bytes(), _resident_after_trim[0]
    if now is not None and last is not None and now - last < min_growth:
        return False
    trimmed = trim_heap()
    _resident_after_trim[0] = resident_bytes()
    return trimmed


def trim_before_backward_of(module) -> None:
    """Before `module`'s own backward (an input embedding's runs last): `trim_after_call()`, which trims only once
    the process grew by CALL_TRIM_MIN_GROWTH, so a small model's update (the tiny job's) pays nothing. Registered
    as a forward hook that hooks the output's gradient, in grad mode only."""

    def _trim_then_pass(grad):
        trim_after_call()
        return grad

    def _hook(_module, _inputs, output):
        if getattr(output, "requires_grad", False):
            output.register_hook(_trim_then_pass)

    module.register_forward_hook(_hook)
