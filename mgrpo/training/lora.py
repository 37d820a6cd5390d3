"""LoRA adapters on the Megatron actor's linear layers, with the base frozen.

Each adapted `ColumnParallelLinear` / `RowParallelLinear` (attention qkv and output projections, the MLP's
fc1/fc2, every local expert's fc1/fc2) gets two parameters, `lora_A` [r, in] and `lora_B` [out, r], and a
forward hook adding `scaling * B @ A @ dropout(x)` to the layer's output (PEFT's formula, scaling =
alpha / r). The base's parameter names stay as they are, so HF loading, export and checkpoints see the
same model; adapter parameters are named `<linear>.lora_A` / `.lora_B`.

Tensor parallelism follows the base's split, and every collective runs on the base layer's own group:
- column-parallel (output split): A is whole, B is split by rows like the weight. Every TP rank's B shard
  contributes to A's gradient, so `A x` passes through megatron's copy-to-TP region (identity forward,
  all-reduce backward); under sequence parallelism `A x` of this rank's tokens is all-gathered instead, and
  A, whose gradient then covers only this rank's tokens, is marked `sequence_parallel` (megatron's
  finalize_model_grads sums those over TP, as for layer norms).
- row-parallel (input split): A is split by columns like the weight, `A x` is summed over TP (reduce-
  scattered over the sequence under sequence parallelism, B then marked `sequence_parallel`), B is whole.
- experts (expert tensor parallelism 1): both whole on their expert-parallel rank, marked `allreduce=False`
  as megatron marks expert weights, so DDP reduces them over the expert-data-parallel group.
A is initialised whole from a seed of the layer's global name (PEFT's kaiming-uniform) and then sliced, so
the adapters start the same at every TP/EP layout; B starts at zero, so step 0 is the base exactly.

The reference model is the same module with the adapters switched off (`LoraAdapters.disabled()`): no
second copy of the weights. `merged()` swaps base + scaling * B @ A into the base weights' data for the
duration of an export (weight sync in merged mode, HF checkpoints) and puts the originals back untouched.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from mgrpo.config.lora import parse_targets

class _Adapter:
    """One adapted linear: its parameters and how its shards talk (see the module docstring)."""

    def __init__(self, name: str, module, kind: str, rank: int, scaling: float, dropout: float, seed: int,
                 init_a: str = "kaiming"):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.name, self.module, self.kind, self.scaling, self.dropout = name, module, kind, scaling, dropout
        w = module.weight
        group = module.tp_group
        tp, tp_rank = group.size(), group.rank()
        self.expert = bool(getattr(module, "is_expert", False))
        self.tp_group = group
        # experts: tokens arrive dispatched, nothing is split or reduced by TP here (expert TP 1)
        self.tp_comm = tp > 1 and not getattr(module, "explicit_expert_comm", False)
        self.sp = self.tp_comm and bool(getattr(module, "sequence_parallel", False))
        out_local, in_local = w.shape
        in_full = in_local * tp if kind == "row" and self.tp_comm else in_local
        gen = torch.Generator().manual_seed(seed)
        a_full = torch.empty(rank, in_full)
        if init_a == "xavier":
            torch.nn.init.xavier_normal_(a_full, generator=gen)
        elif init_a == "uniform":
            torch.nn.init.xavier_uniform_(a_full, generator=gen)
        else:  # PEFT's default for lora_A
            torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=gen)
        if kind == "row" and self.tp_comm:
            a_full = a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        A = torch.nn.Parameter(a_full.to(device=w.device, dtype=w.dtype).contiguous())
        B = torch.nn.Parameter(torch.zeros(out_local, rank, device=w.device, dtype=w.dtype))
        if self.tp_comm:
            split, whole, dim = (B, A, 0) if kind == "column" else (A, B, 1)
            set_tensor_model_parallel_attributes(split, True, dim, 1)
            if self.sp:
                whole.sequence_parallel = True
        if self.expert:  # as megatron marks expert weights: reduced over expert-DP, each rank's own in the norm
            for p, dim in ((A, 1), (B, 0)):
                p.allreduce = False
                set_tensor_model_parallel_attributes(p, True, dim, 1)
        module.register_parameter("lora_A", A)
        module.register_parameter("lora_B", B)
        self.A, self.B = A, B
        if self.tp_comm:  # checkpoints: the split half is a TP shard (megatron would save it as replicated)
            _shard_in_checkpoints(module, {"weight": 0, "bias": 0, "lora_B": 0} if kind == "column"
                                  else {"weight": 1, "lora_A": 1})

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as m

        if self.dropout > 0.0:
            x = F.dropout(x, self.dropout, training=self.module.training)
        h = F.linear(x, self.A)
        if self.kind == "column" and self.tp_comm:
            h = (m.gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sp
                 else m.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
        elif self.kind == "row" and self.tp_comm:
            h = (m.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sp
                 else m.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h, self.B) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of base + scaling * B @ A (both factors are local in the weight's split)."""
        w = self.module.weight
        return (w.detach().float() + self.scaling * (self.B.detach().float() @ self.A.detach().float())).to(w.dtype)


def _shard_in_checkpoints(module, axes: dict) -> None:
    """`module.sharded_state_dict` as megatron's Column/RowParallelLinear writes it, with the adapter's split
    factor among the TP-sharded tensors."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        state = module.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=module.tp_group)

    module.sharded_state_dict = sharded_state_dict


class LoraAdapters:
    """The adapters of one model stage; `enabled` is read by every hook. `saved`: the parameters trained whole
    (PEFT's modules_to_save) with a copy of their initial values, which the reference uses."""

    def __init__(self, adapters: list, saved: Optional[list] = None):
        self.adapters = adapters
        self.saved = saved or []
        self.enabled = True

    def params(self) -> list:
        return [p for a in self.adapters for p in (a.A, a.B)] + [p for p, _ in self.saved]

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: the reference policy (modules trained whole hold their initial weights inside)."""
        self.enabled = False
        swapped = [(p, p.data) for p, _ in self.saved]
        for p, initial in self.saved:
            p.data = initial
        try:
            yield
        finally:
            self.enabled = True
            for p, data in swapped:
                p.data = data

    @contextmanager
    def merged(self) -> Iterator[None]:
        """The adapted linears' weights hold base + scaling * B @ A (and the hooks are off) inside; the
        original tensors are put back afterwards, bit for bit."""
        saved = [(a.module.weight, a.module.weight.data) for a in self.adapters]
        for a in self.adapters:
            a.module.weight.data = a.merged_weight()
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
            for p, data in saved:
                p.data = data

    def merged_stream(self, named):
        """`named` (a lazy export stream) iterated with the weights merged."""
        with self.merged():
            yield from named


def _kind(module) -> Optional[str]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    return None


def _global_name(model, path: str) -> str:
    """`path` with the local decoder layer and local expert indices replaced by global ones (the seed of
    an adapter's initialisation is the same at every pipeline / expert-parallel layout)."""
    parts = path.split(".")
    out, mod = [], model
    for i, p in enumerate(parts):
        mod = getattr(mod, p) if not p.isdigit() else mod[int(p)]
        if p.isdigit() and parts[i - 1] == "layers":
            p = str(mod.layer_number - 1)
        elif p.isdigit() and parts[i - 1] == "local_experts":
            p = str(_parent(model, parts[:i - 2]).local_expert_indices[int(p)])  # the MoE layer's
        out.append(p)
    return ".".join(out)


def _parent(model, parts):
    mod = model
    for p in parts:
        mod = getattr(mod, p) if not p.isdigit() else mod[int(p)]
    return mod


def attach_lora(model, lora, *, num_experts: int, seed: int) -> LoraAdapters:
    """Adapters on `model`'s (one unwrapped stage's) target linears; every other parameter frozen."""
    from mgrpo.config.lora import SAVED

    targets = parse_targets(lora.target_modules, num_experts=num_experts)
    for p in model.parameters():
        p.requires_grad_(False)
    saved, seen = [], set()
    names = list(getattr(lora, "modules_to_save", ()))
    if names and getattr(model, "share_embeddings_and_output_weights", False):
        names = list(SAVED)  # tied: the first stage's embedding and the last stage's copy train as one
    for name in names:  # trained whole; with tied embeddings one shared matrix
        module = _parent(model, SAVED[name].split(".")) if hasattr(model, SAVED[name].split(".")[0]) else None
        p = getattr(module, "weight", None) if module is not None else None
        if p is None or id(p) in seen:  # not on this pipeline stage, or tied to the embedding
            continue
        seen.add(id(p))
        p.requires_grad_(True)
        saved.append((p, p.detach().clone()))
    rank = int(lora.rank)
    scaling = float(lora.alpha) / rank
    adapters = []
    for path, module in list(model.named_modules()):
        kind = _kind(module)
        if kind is None or not targets.matches(path):
            continue
        g = _global_name(model, path)
        adapters.append(_Adapter(g, module, kind, rank, scaling, float(lora.dropout),
                                 seed=(seed * 1_000_003 + zlib.crc32(g.encode())) % 2**63, init_a=lora.init_a))
    state = LoraAdapters(adapters, saved)

    def hook(module, args, output):
        if not state.enabled:
            return output
        a = module._mgrpo_lora
        if isinstance(output, tuple):
            return (output[0] + a.delta(args[0]),) + tuple(output[1:])
        return output + a.delta(args[0])

    for a in adapters:
        a.module._mgrpo_lora = a
        a.module.register_forward_hook(hook)
    return state


def gather_peft(model, model_cfg, ctx) -> Optional[dict]:
    """{PEFT key: CPU tensor} of every adapter of the actor on global rank 0 (None elsewhere): each pipeline
    stage's weight source sends its (small) tensors there, TP shards gathered. Every rank takes part."""
    import torch.distributed as dist

    from mgrpo.models.peft_export import iter_peft_tensors

    mine = {}
    if ctx.exports_weights:
        mine = {k: t.cpu() for k, t in iter_peft_tensors(model, model_cfg, tp_group=ctx.tp_group, tp_size=ctx.tp,
                                                         pp_rank=ctx.pp_rank, pp_size=ctx.pp)}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if ctx.is_weight_source else {}, parts, dst=0)
    return {k: v for p in parts for k, v in p.items()} if dist.get_rank() == 0 else None
