"""The experts each token was routed to, captured from a transformers mixture-of-experts model's own routers:
what the CPU server (sglang/cpu/model.py) and the in-process engine (hf_engine.py) return as
`GenerateResult.routed_experts`, as SGLang 0.5.23 returns them (srt/state_capturer/routed_experts.py,
layers/moe/topk.py: per layer, the top-k expert ids the router chose for every token the model computed).

A forward hook on each transformers router (`*TopKRouter`, whose output is (logits, weights, indices)) keeps
the indices the experts were then called with: the same tensor, not a recomputation.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
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

    @contextlib.contextmanager
    def every_forward(self, model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
        """Inside: the routes of each forward of `model` (transformers' generate runs one per step: the
        prefill [batch, prompt width], then [batch, 1] per fed token) are appended to the list yielded."""
        forwards: list[torch.Tensor] = []

        def hook(module, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            forwards.append(self.take(*ids.shape))

        handle = model.register_forward_hook(hook, with_kwargs=True)
        try:
            yield forwards
        finally:
            handle.remove()
            self._seen = [None] * len(self.modules)


def generated_routes(forwards: list[torch.Tensor], row: int, prompt_len: int, width: int, out_len: int) -> np.ndarray:
    """Request `row`'s routes from the forwards of one left-padded generate() call (prompts end at column
    `width`): its prompt positions in the prefill, then one row per generated token that was fed back,
    i.e. all but the last: [prompt_len + out_len - 1, L, K], as SGLang returns them."""
    prefill = forwards[0][row, width - prompt_len:width]
    fed = [f[row] for f in forwards[1:out_len]]  # the token of step j is fed by forward j + 1
    return torch.cat([prefill, *fed]).numpy()


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
