"""Auxiliary engines (reward models, judges: reward.models.<name>): frozen servers hosted exactly as rollout engines
are, by `EngineHost` actors building an engine of the rollout registry, in the run's placement groups
(`Placement.reward_options`). Their owner (rewards/hosting.py, given `RewardEngines`) reaches them by URL; this
module is the Ray side: start, wait until healthy, health-check (`hosts_alive`), restart through the host (a new host
in the same bundle if the host died), stop.
Nothing here syncs weights or releases memory: the weight sync only knows the rollout group's engines.
"""

from __future__ import annotations

from typing import Optional

import ray

from mgrpo.cluster.engine_host import EngineHost, hosts_alive, stop_host
from mgrpo.cluster.ray_env import start_ray

STARTUP_TIMEOUT_S = 900.0
"""How long a server may take to answer its first health check (SGLangEngine.launch's own start-up limit)."""


class AuxEngineHosts:
    """The hosts of one auxiliary model's servers: `engine` (a registry name) built from `hf_dir` with `kwargs[k]`
    in host k. `placement`: the run's `Placement` (None outside a run: the hosts go wherever the local Ray this
    process starts, or joined, has room)."""

    def __init__(self, name: str, engine: str, hf_dir: str, kwargs: list[dict], *, placement=None, cpus: float = 1,
                 tp: int = 1, timeout_s: float = 60.0):
        self.name, self.engine, self.hf_dir, self.kwargs = name, engine, hf_dir, kwargs
        self.placement, self.cpus, self.tp, self.timeout_s = placement, cpus, tp, timeout_s
        if not ray.is_initialized():  # outside a run: a private local Ray, as a run's
            start_ray(address=None, num_cpus=None)
        self.hosts: list = []
        self.addresses: list[dict] = []
        """`EngineSlot.address()` of each host: node, server URL, server pid."""
        try:
            self.hosts = [self._start(k) for k in range(len(kwargs))]
            self.addresses = self._ready(self.hosts)
        except BaseException:
            self.close()
            raise

    def _start(self, k: int):
        opts = {"num_cpus": 0} if self.placement is None else \
            self.placement.reward_options(self.name, k, cpus=self.cpus, tp=self.tp)
        return EngineHost.options(**opts).remote(self.engine, self.hf_dir, self.kwargs[k])

    def _ready(self, hosts: list) -> list[dict]:
        ray.get([h.health.remote() for h in hosts], timeout=STARTUP_TIMEOUT_S)
        return ray.get([h.address.remote() for h in hosts], timeout=self.timeout_s)

    @property
    def urls(self) -> list[Optional[str]]:
        return [a["url"] for a in self.addresses]

    def dead(self) -> list[int]:
        """The servers whose hosts fail the rollout engines' health check (`hosts_alive`, all asked at once)."""
        return [k for k, ok in enumerate(hosts_alive(self.hosts, self.timeout_s)) if not ok]

    def restart(self, k: int) -> dict:
        """Start server k again through its host (the host process stays, as a hybrid rollout engine's does); a host
        that died or hangs is replaced by a new one in the same bundle. The new server's address."""
        host = self.hosts[k]
        try:
            ray.get(host.stop_engine.remote(), timeout=self.timeout_s)
            ray.get(host.start_engine.remote(self.engine, self.hf_dir, self.kwargs[k]), timeout=STARTUP_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            stop_host(host, self.timeout_s)
            self.hosts[k] = self._start(k)
        self.addresses[k] = self._ready([self.hosts[k]])[0]
        return self.addresses[k]

    def close(self) -> None:
        for host in self.hosts:
            stop_host(host, self.timeout_s)
        self.hosts, self.addresses = [], []


ENGINE = "sglang"
"""The rollout engine registry's entry that builds a reward server (the CPU server stands in where SGLang cannot)."""


class RewardEngines:
    """The `EngineKit` the reward room's hosting part is given (rewards/hosting.py): Ray hosts built by the rollout
    registry's sglang engine, SGLang's client for each server, SGLang's router in front of several."""

    def __init__(self):
        from mgrpo.rollout.sglang.http import SGLangBadResponseError, SGLangRequestError

        self.request_error, self.bad_response = SGLangRequestError, SGLangBadResponseError

    @staticmethod
    def launch(name: str, hf_path: str, kwargs: list[dict], *, placement=None, cpus: float = 1, tp: int = 1,
               timeout_s: float = 60.0) -> AuxEngineHosts:
        return AuxEngineHosts(name, ENGINE, hf_path, kwargs, placement=placement, cpus=cpus, tp=tp,
                              timeout_s=timeout_s)

    @staticmethod
    def connect(url: str, **client_kwargs):
        from mgrpo.rollout.sglang import SGLangEngine

        return SGLangEngine.connect(url, **client_kwargs)

    @staticmethod
    def router(urls: list[str], *, log_dir: str, **client_kwargs):
        from mgrpo.net import node_ip
        from mgrpo.rollout.sglang.router import RoutedClient

        return RoutedClient(urls, host=node_ip(), log_dir=log_dir, **client_kwargs)
