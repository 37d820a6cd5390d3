"""The experts each token was routed to, captured from a transformers mixture-of-experts model's own routers:
what both CPU engines (their decode loop, rollout/decode.py) return as
`GenerateResult.routed_experts`, as SGLang 0.5.23 returns them (srt/state_capturer/routed_experts.py,
layers/moe/topk.py: per layer, the top-k expert ids the router chose for every token the model computed).

A forward hook on each transformers router (`*TopKRouter`, whose output is (logits, weights, indices)) keeps
the indices the experts were then called with: the same tensor, not a recomputation.
"""

from __future__ import annotations

from typing import Optional

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of the decoder layers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def moe_shape(config) -> Optional[tuple[int, int]]:
    """(num_layers, top_k) of routed_experts for an MoE config, None for a dense one."""
    top_k = getattr(config, "num_experts_per_tok", None)
    return (config.num_hidden_layers, top_k) if top_k else None


class RouteCapture:
    """Forward hooks on every router; after a forward, `take(batch, seq)` gives int32 [batch, seq, L, K]."""

    def __init__(self, model: torch.nn.Module, *, what: str = "--enable-return-routed-experts"):
        self.modules = routers(model)
        shape = moe_shape(model.config)
        if shape is None or len(self.modules) != shape[0]:
            raise ValueError(f"{what}: the engine returns routed experts for MoE models whose every layer routes; "
                             f"{type(model).__name__} has {len(self.modules)} routers for "
                             f"{model.config.num_hidden_layers} layers")
        self.top_k = shape[1]
        self._seen: list[Optional[torch.Tensor]] = [None] * len(self.modules)
        for i, mod in enumerate(self.modules):
            mod.register_forward_hook(self._hook(i))

    @property
    def shape(self) -> tuple[int, int]:
        """(num_layers, top_k): one row of routed_experts."""
        return len(self.modules), self.top_k

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


def routes_from_error(start: int, prompt_len: int) -> Optional[str]:
    """SGLang 0.5.23's refusal of a routed_experts_start_len outside [0, prompt tokens] (scheduler.py
    handle_generate_request: the request aborts with this message, answered 400), None when it is in range."""
    if start > prompt_len:  # (checked second there, so its message wins; both cannot hold)
        return (f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len.")
    if start < 0:
        return (f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                "routed_experts_start_len.")
    return None


def check_routes_from(start: int, prompt_len: int) -> None:
    """The in-process engine's form of SGLang's refusal: ValueError with its message."""
    err = routes_from_error(start, prompt_len)
    if err is not None:
        raise ValueError(err)
