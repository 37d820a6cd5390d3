"""SGLang 0.5.23's per-request seeded sampler, in plain torch, for the engines that run on CPU.

With `sampling_params.sampling_seed` (and --enable-deterministic-inference) SGLang draws each row's token
with `srt/layers/sampler.py::multinomial_with_seed`: Gumbel-max over the row's log-probs, the noise of
column c being a MurmurHash3 of (seed, position, c) (`kernels/ops/sampling/murmur_hash.py`: the 64-bit seed,
the 32-bit position and the 32-bit column as four 4-byte blocks, h=0, finalised with len=16; that is
MurmurHash3_x86_32 of those 16 little-endian bytes with seed 0). A row's token is then a function of its
own distribution, seed and position only, never of which rows share its batch: what makes a multi-turn
trajectory reproducible whatever the dispatcher put next to it. `position` is the position of the last
token fed (the model runner passes `seq_lens - 1` at prefill and `positions` at decode), so for the k-th
new token (0-based) of a request with P input tokens it is P - 1 + k.

Both CPU engines sample a seeded request here, through their shared sampler (`rollout/sampler.py`).
SGLang's own CPU path calls sgl_kernel's murmur_hash32_cpu, which is not installed on this machine (its
wheel needs CUDA), so the hash is written out below from the Triton kernel, and tests check it against
MurmurHash3's published reference.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * _C1) & _M32
    k = _rotl(k, 15)
    k = (k * _C2) & _M32
    h = h ^ k
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[n, m] uint32 hashes (as int64) of (seed[i], positions[i], cols[j]), as SGLang's murmur_hash32 kernel.
    Every value is masked to 32 bits before it is multiplied or shifted; a product that passes 2**63 wraps
    modulo 2**64 in int64, which keeps its low 32 bits, the only ones kept."""
    seed = seed.to(torch.int64).view(-1, 1)
    lo = seed & _M32
    hi = (seed >> 32) & _M32  # a negative seed: its two's-complement bits, as the kernel's uint64 cast
    h = _mix(torch.zeros_like(lo), lo)
    h = _mix(h, hi)
    h = _mix(h, positions.to(torch.int64).view(-1, 1) & _M32)  # per row; the columns below
    h = _mix(h.expand(-1, cols.numel()), cols.to(torch.int64).view(1, -1) & _M32)
    return _fmix(h ^ 16)


def multinomial_with_seed(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n, 1] column indices: per row the argmax of logprobs + Gumbel noise from the row's hash (SGLang's
    multinomial_with_seed, float64, with its clamp of both ends of the uniform)."""
    n, m = logprobs.shape
    x = murmur_hash32(seed, positions, torch.arange(m)).to(torch.float64) / float(_M32)
    x.log_().clamp_(min=torch.finfo(x.dtype).min, max=-(2.0 ** -32)).neg_()
    x.log_().neg_()
    x.add_(logprobs.to(torch.float64))
    return torch.argmax(x, dim=1, keepdim=True)

