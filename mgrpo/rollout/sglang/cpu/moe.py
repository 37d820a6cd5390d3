"""Mixture-of-experts pieces of the CPU server: SGLang's weight names for a transformers MoE model, and the
experts each token was routed to, captured from the model's own routers.

Names. SGLang's Qwen3-MoE loader (srt/models/qwen3_moe.py::load_weights) takes one tensor per expert:
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` ([I, H], [I, H], [H, I]) and the router
`model.layers.{l}.mlp.gate.weight` ([E, H]); checkpoints on disk hold the same names. transformers 5 keeps
the experts of a layer fused in memory: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, as its
forward's `.chunk(2)` reads them) and `mlp.experts.down_proj` [E, H, I]. `weight_targets` maps every
SGLang name to the slice of the model's parameter it fills.

Routes: SGLang returns for a request the rows of positions [start, prompt + output - 1); the capture from
the model's own routers is `mgrpo/rollout/route_capture.py::RouteCapture`, which the in-process engine shares.
"""

from __future__ import annotations

import re
from typing import Callable

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
