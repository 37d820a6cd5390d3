"""Rollout engines by name: how each is built, launched from the config, and fed new weights.

The rollout group (`mgrpo/cluster/rollout_group.py`) places one host process per engine and asks this
registry everything engine-specific, so it knows nothing of SGLang's launch arguments or weight
transports. A new engine is one `EngineSpec` here plus its module.

Weight transports: an engine either receives buckets in its host process (`direct_sender` is None;
the trainer hands the bucket to the host, which calls `engine.update_weights`), or the Megatron ranks
push to the engine's server directly (`direct_sender` builds the sender from the engines' addresses).
A `node_local` transport (CUDA IPC / shared memory) reaches only engines on the sending rank's node;
the others still get the bucket through their hosts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from mgrpo.config import MGRPOConfig


@dataclass(frozen=True)
class EngineContext:
    """What the run knows about an engine that the config does not say."""

    eos_token_ids: list[int]
    pad_token_id: int
    log_dir: Optional[str] = None
    visible_devices: Optional[list[str]] = None
    """Accelerator ids the engine's server must use (colocated: those of its Megatron ranks)."""
    api_key: Optional[str] = None
    """The run's secret (`resolve_api_key(rollout.api_key)`): every server and router requires it."""

    def __repr__(self) -> str:  # a context may be logged; its key never is
        return (f"EngineContext(eos_token_ids={self.eos_token_ids}, pad_token_id={self.pad_token_id}, "
                f"log_dir={self.log_dir!r}, visible_devices={self.visible_devices}, "
                f"api_key={'<set>' if self.api_key else None})")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable[[str, dict], object]
    """(hf_dir, kwargs) -> a `RolloutEngine`; runs inside the engine's host process."""
    kwargs: Callable[[MGRPOConfig, EngineContext], dict]
    """The engine's construction arguments for this run."""
    direct_sender: Optional[Callable[[MGRPOConfig, list[dict], int, Optional[str]], object]] = None
    """(config, engine addresses, engine generation, API key) -> a sender Megatron ranks call
    `update_weights(bucket)` on. The generation changes when an engine restarts, so a sender holding
    per-engine state (a process group) is made anew."""
    node_local: Callable[[MGRPOConfig], bool] = lambda cfg: False
    """Whether the direct sender only reaches engines on the sending rank's node."""
    front: Optional[Callable[[MGRPOConfig, list[str], EngineContext], object]] = None
    """(config, engine URLs, context) -> a client in front of several engines (a router) that the rollout
    group generates through instead of asking each engine's host; it must offer `generate`,
    `replace(old_url, new_url)`, `retries`, `refused_requests`, `alive(timeout_s)`, `restart(urls)` (a
    dead or hung front started again in front of the engines' current URLs) and `shutdown`."""
    returns_routes: bool = False
    """Answers `SamplingParams.return_routed_experts` with `GenerateResult.routed_experts` (MoE models), when
    built with `return_routed_experts=True` (what actor.router_replay=rollout asks of every engine)."""


# --- in-process transformers (CPU) -----------------------------------------------------------------
def _build_hf(hf_dir: str, kw: dict):
    from mgrpo.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(hf_dir, **kw)


def _hf_kwargs(cfg: MGRPOConfig, ctx: EngineContext) -> dict:
    return dict(eos_token_ids=list(ctx.eos_token_ids), pad_token_id=ctx.pad_token_id,
                chunk_size=cfg.rollout.generate_chunk, num_threads=cfg.trainer.cpus_per_worker,
                return_routed_experts=returns_routes(cfg), tokenizer=cfg.model.tokenizer)


def returns_routes(cfg: MGRPOConfig) -> bool:
    """Whether every rollout request asks for the experts each token was routed to (actor.router_replay=rollout)."""
    return str(cfg.actor.router_replay) == "rollout"


# --- SGLang servers (or the CPU server speaking their protocol) -----------------------------------
def _build_sglang(hf_dir: str, kw: dict):
    from mgrpo.rollout.sglang.client import SGLangEngine
    from mgrpo.net import node_ip

    kw = dict(kw)
    kw.setdefault("host", node_ip())  # this node's cluster address, never 0.0.0.0
    devices = kw.pop("visible_devices", None)
    if devices:
        kw["env"] = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    return SGLangEngine.launch(hf_dir, **kw)


def _sglang_kwargs(cfg: MGRPOConfig, ctx: EngineContext) -> dict:
    r = cfg.rollout
    return dict(tp=r.tp, ep=r.ep, mem_fraction_static=r.gpu_memory_utilization,
                stop_token_ids=list(ctx.eos_token_ids), max_retries=r.max_retries,
                request_timeout_s=r.request_timeout_s, health_timeout_s=r.health_check_timeout_s,
                log_dir=os.path.join(ctx.log_dir, "sglang") if ctx.log_dir else None,
                enable_memory_saver=r.shares_actor_devices, visible_devices=ctx.visible_devices,
                api_key=ctx.api_key, return_routed_experts=returns_routes(cfg), extra_args=lora_launch_args(cfg))


def lora_launch_args(cfg: MGRPOConfig) -> list[str]:
    """SGLang's LoRA arguments where the engines take the adapters alone (actor.lora.sync resolved to adapter):
    the rank and target modules its adapter pool is sized for, and, with engines on the actor's devices, a CPU
    backup of the (frozen) base weights, which come back on resume instead of being synced again."""
    from mgrpo.config.lora import hf_targets, sync_mode

    lora = cfg.actor.lora
    if not lora.enabled or sync_mode(lora, engine=cfg.rollout.engine, num_experts=cfg.model.num_experts) != "adapter":
        return []
    args = ["--enable-lora", "--max-lora-rank", str(int(lora.rank)), "--lora-target-modules",
            *hf_targets(lora, num_experts=cfg.model.num_experts)]
    return args + (["--enable-weights-cpu-backup"] if cfg.rollout.shares_actor_devices else [])


def _sglang_sender(cfg: MGRPOConfig, addresses: list[dict], generation: int, api_key: Optional[str]):
    urls, tps = [a["url"] for a in addresses], [a["tp"] for a in addresses]
    if cfg.rollout.shares_actor_devices:  # the engine's server is on the sending rank's GPUs
        from mgrpo.rollout.sglang.weights_tensor import TensorWeightSender

        return TensorWeightSender(urls, tps, api_key=api_key)
    from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender

    return DistributedWeightSender(urls, tps, generation=generation, api_key=api_key)


def _sglang_router(cfg: MGRPOConfig, urls: list[str], ctx: EngineContext):
    from mgrpo.net import node_ip
    from mgrpo.rollout.sglang.router import RoutedClient

    r = cfg.rollout
    m = cfg.model
    # multi-turn: a trajectory's turns to the engine whose prefix cache holds its context (sticky sessions)
    policy = "manual" if r.multi_turn.enable else "round_robin"
    return RoutedClient(urls, host=node_ip(), log_dir=os.path.join(ctx.log_dir, "router") if ctx.log_dir else None,
                        policy=policy, stop_token_ids=list(ctx.eos_token_ids), max_retries=r.max_retries,
                        request_timeout_s=r.request_timeout_s, api_key=ctx.api_key,
                        moe_shape=(m.num_layers, m.moe_router_topk) if m.num_experts else None)


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("hf", _build_hf, _hf_kwargs, returns_routes=True),
    "sglang": EngineSpec("sglang", _build_sglang, _sglang_kwargs, direct_sender=_sglang_sender,
                         node_local=lambda cfg: cfg.rollout.shares_actor_devices, front=_sglang_router,
                         returns_routes=True),
}


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine={name!r} is not one of {sorted(ENGINES)}") from None


def build_engine(name: str, hf_dir: str, kwargs: dict):
    return engine_spec(name).build(hf_dir, kwargs)


def resolve_api_key(cfg: MGRPOConfig) -> Optional[str]:
    """The run's secret for the rollout fleet (rollout.api_key; see rollout/sglang/auth.py), None when off."""
    from mgrpo.rollout.sglang.auth import resolve_api_key as resolve

    return resolve(cfg.rollout.api_key)
