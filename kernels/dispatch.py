"""The kernels' one interface (mgrpo_kernels re-exports it): three implementations behind one interface, picked by `impl` (config: actor.logprob_impl):
  "chunked"  torch, never more than one chunk of logits (reference.py's fast twin; CPU default)
  "fused"    Triton kernels, logits only as register tiles (GPU; CPU under TRITON_INTERPRET=1)
  "naive"    reference.py, full [T, V] logits (the oracle; small vocabularies only)
All three take `weight` as this rank's vocabulary shard and return the same fp32 results, optionally
renormalised over each token's sampling support (top-k / top-p; `support_offsets`, `support_ids`, see
support.py). Triton is imported only when "fused" is asked for and usable, so this package imports
without it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from mgrpo.config.choices import LogprobImpl, values

from . import chunked
from .chunked import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK
from .reference import full_linear_loss, full_logprobs
from .support import check_support

IMPLS = tuple(values(LogprobImpl))  # actor.logprob_impl


def capabilities() -> dict:
    """What this process can run; checked at call time (a CPU box may still import triton)."""
    caps = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "triton": None}
    try:
        import triton

        caps["triton"] = triton.__version__
    except ImportError:
        pass
    except Exception as exc:  # a broken install must not break the torch paths
        caps["triton_error"] = repr(exc)
    caps["fused"] = caps["triton"] is not None and (caps["cuda"] or caps["triton_interpret"])
    return caps


def _triton_impl(hidden: torch.Tensor):
    caps = capabilities()
    missing = []
    if caps["triton"] is None:
        missing.append("the triton package (pip install -c constraints.txt -e '.[triton]')"
                       + (f": {caps['triton_error']}" if "triton_error" in caps else ""))
    if not (hidden.is_cuda or caps["triton_interpret"]):
        missing.append("a CUDA device holding the tensors" if caps["cuda"] else "a CUDA device")
    if missing:
        raise RuntimeError(
            "actor.logprob_impl=fused needs Triton on a CUDA device (or TRITON_INTERPRET=1 for CPU tests); "
            "missing: " + "; ".join(missing) + ". Use actor.logprob_impl=chunked on this machine.")
    from . import triton_kernel

    return triton_kernel


class _GatherVocabShards(torch.autograd.Function):
    """The naive path under TP: rebuild the full output layer on every rank.

    The loss after it is computed identically on every rank, so each rank's gradient w.r.t. the full
    weight is already complete: the backward keeps this rank's rows (no reduction, no double count).
    """

    @staticmethod
    def forward(ctx, weight, group):
        parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, weight.contiguous(), group=group)
        ctx.rank, ctx.rows = dist.get_rank(group), weight.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def _naive_weight(weight, tp_group, vocab_start):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        if vocab_start != 0:
            raise ValueError("vocab_start != 0 needs the tp_group the weight is sharded over")
        return weight
    if vocab_start != dist.get_rank(tp_group) * weight.shape[0]:
        raise ValueError("impl=naive expects equal vocabulary shards in group-rank order (Megatron layout)")
    return _GatherVocabShards.apply(weight, tp_group)


def _check(impl, hidden, weight, labels, support_offsets, support_ids, tp_group, vocab_start, vocab_size):
    """Validate the arguments; the support as (offsets, ids) int64 tensors, or None."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS} (actor.logprob_impl)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V_local, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [T]={hidden.shape[0]}, got {tuple(labels.shape)}")
    if (support_offsets is None) != (support_ids is None):
        raise ValueError("support_offsets and support_ids go together (both or neither)")
    if support_offsets is None:
        return None
    if vocab_size is None:  # the whole (unpadded) vocabulary: every rank's rows
        world = 1 if tp_group is None else dist.get_world_size(tp_group)
        vocab_size = vocab_start + weight.shape[0] if world == 1 else world * weight.shape[0]
    check_support(support_offsets, support_ids, labels, vocab_size)
    return support_offsets.long(), support_ids.long()


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK,
                    tp_group: Optional[dist.ProcessGroup] = None, vocab_start: int = 0,
                    vocab_size: Optional[int] = None, compute_entropy: bool = True, impl: str = "chunked",
                    support_offsets: Optional[torch.Tensor] = None, support_ids: Optional[torch.Tensor] = None):
    """(logprob [T] fp32, entropy [T] fp32 or None) of `labels` (global ids) under
    softmax(hidden @ weight.T / temperature) over the real vocabulary, differentiable w.r.t. hidden
    and weight. With `tp_group`, `weight` holds rows [vocab_start, vocab_start + V_local) of the
    padded vocabulary, `hidden` is replicated over the group and its grad comes back all-reduced.
    With a support (CSR: `support_offsets` [T+1], `support_ids` [nnz] global ids, an empty row = the
    whole vocabulary) each token's softmax, log-prob and entropy are over its own support only.
    """
    support = _check(impl, hidden, weight, labels, support_offsets, support_ids, tp_group, vocab_start, vocab_size)
    if impl == "naive":
        w = _naive_weight(weight, tp_group, vocab_start)
        return full_logprobs(hidden, w, labels, temperature=temperature, vocab_size=vocab_size,
                             compute_entropy=compute_entropy, support_offsets=support_offsets,
                             support_ids=support_ids)
    if impl == "fused":
        cfg = chunked.make_config(temperature, chunk_size, vocab_chunk_size, tp_group, vocab_start, vocab_size,
                                  compute_entropy, support)
        return _triton_impl(hidden).TritonLinearLogprobs.apply(hidden, weight, labels, cfg)
    return chunked.linear_logprobs(hidden, weight, labels, temperature=temperature, chunk_size=chunk_size,
                                   vocab_chunk_size=vocab_chunk_size, tp_group=tp_group, vocab_start=vocab_start,
                                   vocab_size=vocab_size, compute_entropy=compute_entropy, support=support)


def fused_linear_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_loss_fn, *,
                      temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK, tp_group: Optional[dist.ProcessGroup] = None,
                      vocab_start: int = 0, vocab_size: Optional[int] = None, compute_entropy: bool = True,
                      impl: str = "chunked", support_offsets: Optional[torch.Tensor] = None,
                      support_ids: Optional[torch.Tensor] = None, grad_weight_into: Optional[torch.Tensor] = None,
                      grad_scale: Optional[float] = None):
    """(loss scalar, metrics {name: scalar}, logprob [T] detached, entropy [T] detached or None).

    token_loss_fn(logprob_chunk, entropy_chunk, sl) -> (loss_sum_chunk, {name: scalar}) is any
    token-local loss (its per-token weights carry mask and normalisation); loss and metrics are sums
    over chunks. "chunked" and "fused" compute dHidden/dWeight during this call; backward scales them.
    The support arguments are those of `linear_logprobs`. `grad_weight_into` with `grad_scale` ("chunked" and
    "fused"): dWeight * grad_scale goes into that float32 buffer (Megatron DDP's main_grad) during the forward,
    never through autograd; grad_scale is the gradient the loss will receive (chunked.fused_linear_loss).
    """
    support = _check(impl, hidden, weight, labels, support_offsets, support_ids, tp_group, vocab_start, vocab_size)
    if impl == "naive" and grad_weight_into is not None:
        raise ValueError("grad_weight_into is for the chunked and fused kernels; the naive oracle leaves "
                         "dWeight to autograd")
    if impl == "naive":
        w = _naive_weight(weight, tp_group, vocab_start)
        return full_linear_loss(hidden, w, labels, token_loss_fn, temperature=temperature, vocab_size=vocab_size,
                                compute_entropy=compute_entropy, support_offsets=support_offsets,
                                support_ids=support_ids)
    if impl == "fused":  # (the chunked entry checks grad_weight_into itself)
        chunked.check_grad_weight_into(grad_weight_into, grad_scale, weight)
        cfg = chunked.make_config(temperature, chunk_size, vocab_chunk_size, tp_group, vocab_start, vocab_size,
                                  compute_entropy, support, grad_weight_into, grad_scale)
        metrics: dict = {}
        loss, logprob, entropy = _triton_impl(hidden).TritonFusedLinearLoss.apply(
            hidden, weight, labels, token_loss_fn, cfg, metrics)
        return loss, metrics, logprob, entropy
    return chunked.fused_linear_loss(hidden, weight, labels, token_loss_fn, temperature=temperature,
                                     chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, tp_group=tp_group,
                                     vocab_start=vocab_start, vocab_size=vocab_size, compute_entropy=compute_entropy,
                                     support=support, grad_weight_into=grad_weight_into, grad_scale=grad_scale)
