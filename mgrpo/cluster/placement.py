"""Where every process goes: Ray placement groups for the Megatron ranks and the rollout engines.

Accelerator bundles are used whenever the Ray cluster has GPU resources. That is decided by asking
Ray, not torch, so the GPU branches of placement also run on a CPU machine whose Ray nodes were started
with logical GPUs (`ray start --num-gpus 8`): only the compute leaf differs.

- Trainer: one bundle per Megatron rank, `{CPU: c, GPU: 1}`, packed onto as few nodes as possible.
- Colocated rollout: engines share the actor's accelerators. Engine i's host actor takes a fraction
  of the first GPU of Megatron ranks [i*tp, (i+1)*tp) (Megatron ranks leave that fraction free), and its
  server is pointed at exactly those ranks' GPUs, which must sit on one node.
- Hybrid rollout: no process of its own; engine i lives in Megatron rank i*tp's actor (its bundle) and its
  server, if it has one, uses the GPUs of Megatron ranks [i*tp, (i+1)*tp).
- Disaggregated rollout: one bundle per engine with `rollout.tp` GPUs of its own.
- Reward engines (reward.models.<name>, launched; not those at a url): placement=own, one bundle per engine with
  `tp` GPUs of its own (a placement group per model, `mgrpo-reward-<name>`); placement=shared, engine k's host sits
  in rollout engine (k mod num_engines)'s bundle (or its Megatron rank's, when the rollout has no bundles of its
  own), claiming no CPU or GPU of it: its server is pointed at that rollout engine's accelerators and holds
  `gpu_memory_utilization` of them for the whole run (mgrpo-plan checks that it fits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from mgrpo.cluster.ray_env import Bundles, reserve, start_ray
from mgrpo.config import Layout, MGRPOConfig

ENGINE_GPU_SHARE = 0.2
"""Fraction of a GPU a colocated engine's host actor claims in the Megatron bundle it shares (the host
itself only talks HTTP; the memory split is SGLang's `mem_fraction_static`, Ray just needs room)."""


@dataclass
class Placement:
    megatron: Bundles
    rollout: Bundles | None
    """Own bundles of disaggregated engines; None when the engines use the trainer's (or live in its ranks)."""
    gpus: bool
    """Bundles carry GPU resources (real GPUs, or logical ones on a CPU test cluster)."""
    hosts_in_actor_bundles: bool
    """Engine hosts sit in the Megatron bundles (rollout.mode=colocated with accelerators)."""
    engine_tp: int
    hybrid: bool = False
    """Engines live in Megatron ranks' processes (rollout.mode=hybrid): no bundles or hosts of their own."""
    reward: dict[str, Bundles] = field(default_factory=dict)
    """Own bundles of each launched reward model with placement=own (reward.models.<name>)."""
    num_engines: int = 1
    """rollout.num_engines (where shared reward engines go)."""

    @property
    def engines_use_actor_gpus(self) -> bool:
        """Engines' servers must use their Megatron ranks' accelerators (engines that share the actor's
        devices, `RolloutConfig.shares_actor_devices`, on GPUs)."""
        return self.gpus and (self.hosts_in_actor_bundles or self.hybrid)

    @property
    def megatron_gpus(self) -> float:
        """GPU resource each Megatron rank asks for."""
        if not self.gpus:
            return 0.0
        return 1.0 - ENGINE_GPU_SHARE if self.hosts_in_actor_bundles else 1.0

    def engine_options(self, index: int, cpus: float) -> dict:
        """Ray options of engine `index`'s host actor: its bundle, CPU and GPU resources. A host sharing a
        Megatron bundle claims no CPU of it (the Megatron rank holds the bundle's CPUs; the host only drives
        its server, whose work is on the accelerators)."""
        if self.hosts_in_actor_bundles:
            return {"scheduling_strategy": self.megatron.strategy(index * self.engine_tp), "num_cpus": 0,
                    "num_gpus": ENGINE_GPU_SHARE}
        return {"scheduling_strategy": self.rollout.strategy(index), "num_cpus": cpus,
                "num_gpus": float(self.engine_tp) if self.gpus else 0.0}

    def engine_ranks(self, index: int) -> range:
        """Megatron ranks whose accelerators engine `index` uses (`engines_use_actor_gpus`), or whose process
        hosts it (`hybrid`)."""
        return range(index * self.engine_tp, (index + 1) * self.engine_tp)

    def reward_options(self, name: str, index: int, *, cpus: float, tp: int) -> dict:
        """Ray options of reward model `name`'s engine `index` host: its own bundle (placement=own), else the
        bundle of the rollout engine it shares (no CPU or GPU claimed: the rollout engine's host holds them)."""
        if name in self.reward:
            return {"scheduling_strategy": self.reward[name].strategy(index), "num_cpus": cpus,
                    "num_gpus": float(tp) if self.gpus else 0.0}
        engine = index % self.num_engines
        if self.rollout is not None:
            return {"scheduling_strategy": self.rollout.strategy(engine), "num_cpus": 0, "num_gpus": 0}
        return {"scheduling_strategy": self.megatron.strategy(engine * self.engine_tp), "num_cpus": 0,
                "num_gpus": 0}

    def remove(self) -> None:
        for b in (self.megatron, self.rollout, *self.reward.values()):
            if b is not None:
                b.remove()


def place(cfg: MGRPOConfig, layout: Layout) -> Placement:
    """Start (or join) Ray and reserve the bundles of this run."""
    t, r = cfg.trainer, cfg.rollout
    cpus = t.cpus_per_worker
    local_cpu = t.device == "cpu" and not t.ray_address
    # A local CPU Ray is told exactly how many CPU slots it may hand out (a bundle is a logical slot).
    hybrid = r.mode == "hybrid"
    own_rewards = launched_reward_models(cfg, "own")
    start_ray(address=t.ray_address, num_cpus=cpus * bundle_count(cfg, layout, gpus=False) + 1 if local_cpu else None)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    # Without accelerators there is nothing to share: colocated engines get CPU slots of their own
    # (colocated mode still releases and resumes engine memory around training).
    in_actor_bundles = r.mode == "colocated" and gpus
    megatron = reserve(layout.megatron_world, cpus=cpus, gpus=1 if gpus else 0, name="mgrpo-megatron")
    rollout = None if in_actor_bundles or hybrid else reserve(r.num_engines, cpus=cpus, gpus=r.tp if gpus else 0,
                                                    name="mgrpo-rollout")
    reward = {}
    try:
        for name, m in own_rewards.items():
            reward[name] = reserve(m.engines, cpus=cpus, gpus=m.tp if gpus else 0, name=f"mgrpo-reward-{name}")
    except BaseException:
        for b in (megatron, rollout, *reward.values()):
            if b is not None:
                b.remove()
        raise
    return Placement(megatron=megatron, rollout=rollout, gpus=gpus, hosts_in_actor_bundles=in_actor_bundles,
                     engine_tp=r.tp, hybrid=hybrid, reward=reward, num_engines=r.num_engines)


def bundle_count(cfg: MGRPOConfig, layout: Layout, *, gpus: bool) -> int:
    """The bundles `place` reserves, trainer.cpus_per_worker CPUs each: one per Megatron rank, one per rollout
    engine unless the engines live in the ranks' bundles (colocated on accelerators) or processes (hybrid), one
    per engine of each reward model launched with placement=own."""
    r = cfg.rollout
    engines = 0 if r.mode == "hybrid" or (r.mode == "colocated" and gpus) else layout.num_engines
    return layout.megatron_world + engines + sum(m.engines for m in launched_reward_models(cfg, "own").values())


def launched_reward_models(cfg: MGRPOConfig, placement: str) -> dict:
    """The reward models this run launches (not one at a url, nor a judge at an OpenAI endpoint) with the given
    placement (own | shared)."""
    return {name: m for name, m in cfg.reward.models.items()
            if not m.url and not (m.kind == "generative" and m.judge.openai_url) and str(m.placement) == placement}


def engine_gpu_ids(rank_devices: list[dict], ranks: range, index: int) -> list[str]:
    """The accelerator ids engine `index` must use when `engines_use_actor_gpus`: those of its Megatron ranks, which must
    all be on one node (a TP engine cannot span nodes)."""
    picked = [rank_devices[k] for k in ranks]
    nodes = {d["node_ip"] for d in picked}
    if len(nodes) != 1:
        raise RuntimeError(f"colocated rollout engine {index} would span nodes {sorted(nodes)} (Megatron ranks "
                           f"{list(ranks)}); rollout.tp must divide trainer.n_gpus_per_node")
    ids = [g for d in picked for g in d["gpu_ids"]]
    if len(ids) != len(ranks):
        raise RuntimeError(f"colocated rollout engine {index}: Megatron ranks {list(ranks)} report GPUs {ids}")
    return ids
