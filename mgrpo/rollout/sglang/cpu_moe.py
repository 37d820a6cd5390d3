"""Mixture-of-experts pieces of the CPU server: SGLang's weight names for a transformers MoE model, and the
experts each token was routed to, captured from the model's own routers.

Names. SGLang's Qwen3-MoE loader (srt/models/qwen3_moe.py::load_weights) takes one tensor per expert:
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` ([I, H], [I, H], [H, I]) and the router
`model.layers.{l}.mlp.gate.weight` ([E, H]); checkpoints on disk hold the same names. transformers 5 keeps
the experts of a layer fused in memory: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, as its
forward's `.chunk(2)` reads them) and `mlp.experts.down_proj` [E, H, I]. `weight_targets` maps every
SGLang name to the slice of the model's parameter it fills.

Routes. SGLang (srt/state_capturer/routed_experts.py, layers/moe/topk.py) records, per layer, the top-k
expert ids its router chose for every token it computed, and returns for a request the rows of positions
[start, prompt + output - 1). Here a forward hook on each transformers router (`*TopKRouter`, whose output
is (logits, weights, indices)) keeps the indices the experts were then called with: the same tensor, not a
recomputation.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def weight_targets(model: torch.nn.Module) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """SGLang/checkpoint name -> (parameter name, view of that parameter the tensor is copied into)."""
    targets: dict[str, tuple[str, Callable]] = {}
    for name, p in model.named_parameters():
        m = _FUSED.match(name)
        if m is None or p.dim() != 3:
            targets[name] = (name, lambda t, _n=name: t)
            continue
        prefix, experts = m["prefix"], p.shape[0]
        for e in range(experts):
            if m["kind"] == "down_proj":
                targets[f"{prefix}.{e}.down_proj.weight"] = (name, lambda t, _e=e: t[_e])
            else:
                half = p.shape[1] // 2
                targets[f"{prefix}.{e}.gate_proj.weight"] = (name, lambda t, _e=e, _h=half: t[_e, :_h])
                targets[f"{prefix}.{e}.up_proj.weight"] = (name, lambda t, _e=e, _h=half: t[_e, _h:])
    return targets


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of the decoder layers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def moe_shape(config) -> Optional[tuple[int, int]]:
    """(num_layers, top_k) of routed_experts for an MoE config, None for a dense one."""
    top_k = getattr(config, "num_experts_per_tok", None)
    return (config.num_hidden_layers, top_k) if top_k else None


class RouteCapture:
    """Forward hooks on every router; after a forward, `take(batch, seq)` gives int32 [batch, seq, L, K]."""

    def __init__(self, model: torch.nn.Module):
        self.modules = routers(model)
        shape = moe_shape(model.config)
        if shape is None or len(self.modules) != shape[0]:
            raise ValueError(f"--enable-return-routed-experts: the CPU server returns routed experts for MoE models "
                             f"whose every layer routes; {type(model).__name__} has {len(self.modules)} routers for "
                             f"{model.config.num_hidden_layers} layers")
        self.top_k = shape[1]
        self._seen: list[Optional[torch.Tensor]] = [None] * len(self.modules)
        for i, mod in enumerate(self.modules):
            mod.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._seen[layer] = output[2].detach()  # (logits, weights, indices): what the experts receive
        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        if any(t is None for t in self._seen):
            raise RuntimeError("a router did not run during the forward")
        out = torch.stack([t.reshape(batch, seq, self.top_k) for t in self._seen], dim=2).to(torch.int32)
        self._seen = [None] * len(self.modules)
        return out
