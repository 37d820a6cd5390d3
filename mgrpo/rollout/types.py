"""What goes into and comes out of a rollout engine, whatever the engine (SGLang server or the
in-process transformers engine on CPU)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:  # annotations only: the driver imports this module before torch (components/assemble.py)
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    seed: int | None = None
    """Seeds the engine's sampler for this call (reproducible rollouts on CPU; best effort on GPU)."""
    return_support: bool = False
    """Ask the engine for each output token's sampling support."""
    return_routed_experts: bool = False
    """Ask the engine for the experts each token was routed to (MoE models; an SGLang server must run with
    --enable-return-routed-experts)."""
    structural_tag: Optional[str] = None
    """SGLang's `sampling_params.structural_tag` (a JSON string): the grammar the engine enforces with xgrammar,
    e.g. the tool-call constraint SGLang's FunctionCallParser builds (rollout.multi_turn.tool_choice)."""
    stop: tuple[str, ...] = ()
    """SGLang's `sampling_params.stop`: texts that end the response when the decoded tail (the longest stop's
    length in tokens + 1) holds one, as SGLang checks it (rollout/stops.py; kept in the ids, finish_reason
    'stop')."""
    stop_regex: tuple[str, ...] = ()
    """SGLang's `sampling_params.stop_regex`: patterns that end the response when `re.search` finds one in the
    decoded tail (after the stop strings; rollout/stops.py), kept in the ids, finish_reason 'stop'."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    uid: int
    """Position of the request in the caller's list; results come back under the same uid."""
    prompt_ids: list[int]
    session: Optional[str] = None
    """Requests of one session (the turns of a multi-turn trajectory) go to one engine, whose prefix cache
    holds the context they share: the rollout group sends them to the same engine, SGLang's router (its
    `manual` policy) by the `x-smg-routing-key` header. None: any engine."""
    seed: Optional[int] = None
    """This request's own sampling seed (SGLang's per-request `sampling_params.sampling_seed`: a multi-turn
    turn's `seeds.turn_seed`); the engines sample it with SGLang's seeded sampler (rollout/seeded.py), so its
    tokens do not depend on the other requests of its batch. None: derived from SamplingParams.seed and uid."""
    routes_from: int = 0
    """SGLang's `routed_experts_start_len` (with SamplingParams.return_routed_experts): the routes of positions
    [routes_from, prompt + output - 1) only, not of the whole sequence (a multi-turn turn asks only for the rows
    its trajectory does not hold yet). SGLang refuses it outside [0, len(prompt_ids)]."""


@dataclass
class GenerateResult:
    uid: int
    token_ids: list[int]
    """Response tokens, including the EOS token when the response stopped on it."""
    logprobs: list[float]
    """Log-prob of each response token under the engine's weights at the sampling temperature
    (the full tempered distribution, before top-p/top-k truncation), as the trainer computes it; with
    SamplingParams.return_support, the behaviour log-probs over that token's support (`support`)."""
    finish_reason: str
    """'stop' (EOS sampled) or 'length' (max_new_tokens reached)."""
    weight_version: int
    engine: int | str | None = None
    """Which engine produced it, set by the rollout group: the engine's index when the group chose it, or
    'router' when SGLang's router did (SGLang 0.5.23's meta_info names no server: id, finish_reason,
    prompt_tokens, weight_version, num_retractions, and dp_rank only between one server's DP ranks)."""
    support: Optional[list[Optional[list[int]]]] = None
    """Per response token: the ascending vocabulary ids the token was sampled from (top-k then top-p of the
    tempered distribution); None for a token sampled from the whole vocabulary; the field is None when not
    asked. When asked, `logprobs` are the behaviour log-probs over that support."""
    routed_experts: Optional[np.ndarray] = None
    """int32 [prompt + response - 1, num_layers, top_k]: the logical experts each token was routed to, one row
    per position up to the last response token (which was never fed back); None when not asked."""


def to_columns(items: Sequence) -> dict[str, list]:
    """Dataclass instances of one type as {field: [each item's value]}: how an engine call's requests and results
    cross Ray. Ray pickles 256 GenerateRequests out and 256 GenerateResults back slower as objects than as these
    lists (`python -m benchmarks.measure.engine_call`)."""
    if not items:
        return {}
    return {f.name: [getattr(x, f.name) for x in items] for f in fields(items[0])}


def from_columns(cls: type, columns: dict[str, list]) -> list:
    """`to_columns`' inverse: the instances of `cls`, in order."""
    names = list(columns)
    return [cls(**dict(zip(names, values))) for values in zip(*columns.values())]


@dataclass
class EngineHealth:
    ok: bool
    weight_version: int
    support: Optional[list[Optional[list[int]]]] = None
    """Per response token: the ascending vocabulary ids the token was sampled from (top-k then top-p of the
    tempered distribution); None for a token sampled from the whole vocabulary; the field is None when not
    asked. When asked, `logprobs` are the behaviour log-probs over that support."""
    routed_experts: Optional[np.ndarray] = None
    """int32 [prompt + response - 1, num_layers, top_k]: the logical experts each token was routed to, one row
    per position up to the last response token (which was never fed back); None when not asked."""
    detail: dict = field(default_factory=dict)


class WeightDeliveryError(RuntimeError):
    """Weights could not be delivered to an engine (it died or stopped answering while it took them). The
    ranks finished their export stream regardless, so the sync can be made again once the engine is back."""


class RolloutEngine(Protocol):
    """Everything an engine's host (`cluster/engine_host.py::EngineSlot`) and the rollout group use of an engine
    (the CPU transformers engine, the SGLang client). `EngineDefaults` has the optional members' defaults: an
    engine subclasses it and writes what it needs."""

    url: Optional[str]
    """Its server's address, which weight senders that post to the server directly use; None in-process."""
    tp: int
    """Tensor-parallel size of its server (the weight senders' group size)."""
    releases_memory: bool
    """It holds accelerator memory it can give back (`release_memory`); False: the calls are never made."""

    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]: ...

    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named, HF-layout tensors."""

    def finish_weight_update(self, version: int) -> None:
        """All buckets of one sync have arrived: verify completeness and bump the weight version."""

    def health(self) -> EngineHealth: ...

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Engines on the actor's devices: free accelerator memory (all, or the named parts) while the trainer
        runs."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take it back: ["weights"] before a weight sync, everything before generating."""

    @property
    def retries(self) -> Optional[int]:
        """Requests it retried itself so far (HTTP errors, aborted requests), for metrics; None: it never
        retries, and is never asked."""

    def refused_requests(self) -> Optional[int]:
        """Requests its server refused for a missing or wrong key so far; None: it does not count them."""

    def share(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """rollout.mode=hybrid (the engine in a Megatron rank's process): use these trainer tensors' memory for
        its own weights of the same name where it can; return the bytes that frees."""

    def shutdown(self) -> None:
        """Stop what it owns (a server); its host process stays."""


class EngineDefaults:
    """The optional members of `RolloutEngine`, for an engine that owns no server and no accelerator memory,
    never retries, counts no refusals and shares nothing: subclass it and override what differs."""

    url: Optional[str] = None
    tp: int = 1
    releases_memory: bool = False

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        pass

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        pass

    @property
    def retries(self) -> Optional[int]:
        return None

    def refused_requests(self) -> Optional[int]:
        return None

    def share(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        return 0

    def shutdown(self) -> None:
        pass
