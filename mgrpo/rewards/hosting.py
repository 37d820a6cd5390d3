"""Hosting a reward model's or judge's servers: the part `RewardModel` and `GenerativeJudge` use (composition).

The servers are hosted exactly as rollout engines are: `EngineHost` actors in the run's placement groups (bundles of
their own with placement=own, the rollout engines' with placement=shared), built by the rollout engine registry's
`sglang` engine with the run's API key; they are frozen (nothing here syncs weights or releases memory). This room
sits below the processes, so what starts and reaches them comes in as `engines`, an `EngineKit`
(cluster/aux_engines.py `RewardEngines` is the run's: Ray hosts, SGLang clients, SGLang's router).

The scorer talks to the servers by URL. Several servers of a judge sit behind SGLang's router, which spreads its
/generate requests; a classifier's /classify requests go to its servers in turn (`spread`). When a call fails (and,
behind a router, before each scoring call) every server's host is health-checked; a dead or hung one is started
again in its bundle (counted in reward/model_restarts), the router re-pointed at its new URL, and the failed call
sent once more. A server at a url (reward.models.<name>.url) is only connected to.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Protocol

from mgrpo.config.reward import RewardModelConfig, engine_share
from mgrpo.rewards.scoring import FAILED, TIMEOUT, ScoreResult

log = logging.getLogger("mgrpo")


class EngineKit(Protocol):
    """How servers are started and reached (cluster/aux_engines.py `RewardEngines`)."""

    request_error: type
    """The exception a failed call raises (SGLang's client: `SGLangRequestError`, with `.timeout`)."""
    bad_response: type
    """The exception for an answer that is not the protocol's (a subclass of `request_error`)."""

    def launch(self, name: str, hf_path: str, kwargs: list[dict], *, placement, cpus: float, tp: int,
               timeout_s: float): ...

    def connect(self, url: str, **client_kwargs): ...

    def router(self, urls: list[str], *, log_dir: str, **client_kwargs): ...


class EngineHosting:
    """One named model's servers: their hosts, the clients and router they are reached through, their restarts."""

    def __init__(self, name: str, cfg: RewardModelConfig, engines: EngineKit, *, api_key: Optional[str],
                 log_dir: str, server_flags: tuple[str, ...], routed: bool, label: str, placement=None,
                 devices: Optional[list[list[str]]] = None, cpus: float = 1):
        """`placement`: the run's `Placement` (its reward bundles); None outside a run (the hosts go wherever the
        Ray this process started or joined has room). `devices[k]`: the accelerator ids server k must use
        (placement=shared: its rollout engine's), else None. `cpus`: CPUs of an own bundle's host. `routed`:
        several servers sit behind SGLang's router. `label`: how a restart is named in the log."""
        self.name, self.cfg, self.kit, self.api_key, self.log_dir = name, cfg, engines, api_key, log_dir
        self.label, self.server_flags, self.routed = label, server_flags, routed
        self.restarts = 0
        self._turn = 0
        self._lock = threading.Lock()
        self.servers = None
        """The servers' hosts (cluster/aux_engines.py `AuxEngineHosts`); None for a server at a url."""
        self.front = None
        """SGLang's router in front of several servers (a `RoutedClient`): scoring goes through it."""
        if cfg.url:
            self.engines = [engines.connect(cfg.url, **self._client_kwargs())]
            return
        self.engines = []
        try:
            kwargs = [self._engine_kwargs(k, devices) for k in range(cfg.engines)]
            self.servers = engines.launch(name, cfg.hf_path, kwargs, placement=placement, cpus=cpus, tp=cfg.tp,
                                          timeout_s=cfg.timeout_s)
            self.engines = [engines.connect(url, **self._client_kwargs()) for url in self.servers.urls]
            if routed and len(self.engines) > 1:
                self.front = engines.router(self.servers.urls, log_dir=os.path.join(log_dir, "router"),
                                            **self._client_kwargs())
        except BaseException:
            self.close()
            raise

    def _client_kwargs(self) -> dict:
        return dict(request_timeout_s=self.cfg.timeout_s, max_retries=self.cfg.max_retries, api_key=self.api_key)

    def _engine_kwargs(self, k: int, devices) -> dict:
        """What the registry's sglang engine is launched with: the scorer's flags, frozen (no memory saver)."""
        c = self.cfg
        return dict(tp=c.tp, mem_fraction_static=engine_share(c), enable_memory_saver=False,
                    extra_args=[*self.server_flags, *c.server_args], api_key=self.api_key,
                    log_dir=os.path.join(self.log_dir, f"engine-{k}"), request_timeout_s=c.timeout_s,
                    max_retries=c.max_retries, visible_devices=devices[k] if devices else None)

    @property
    def hosts(self) -> list:
        return self.servers.hosts if self.servers is not None else []

    @property
    def addresses(self) -> list[dict]:
        """`EngineSlot.address()` of each server's host: node, URL, server pid."""
        return self.servers.addresses if self.servers is not None else []

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _restart(self, k: int) -> None:
        """Start server k again through its host, in the same bundle; re-point the router."""
        old = self.addresses[k]
        log.warning("reward %s %s: server %d at %s (pid %s) failed its health check; starting it again in its "
                    "bundle", self.label, self.name, k, old["url"], old.get("pid"))
        new = self.servers.restart(k)
        self.engines[k] = self.kit.connect(new["url"], **self._client_kwargs())
        self.restarts += 1
        if self.front is not None:
            if self.front.alive(self.cfg.timeout_s):
                self.front.replace(old["url"], new["url"])
            else:
                self.front.restart(self.urls)

    def revive(self) -> int:
        """Health-check every server's host, restarting each dead or hung one (and the router if it died);
        the number restarted. Scoring threads share the servers, so this holds a lock: one restart per death."""
        if self.servers is None:
            return 0
        with self._lock:
            restarted = 0
            for k in self.servers.dead():
                self._restart(k)
                restarted += 1
            if self.front is not None and not self.front.alive(self.cfg.timeout_s):
                self.front.restart(self.urls)
                restarted += 1
            return restarted

    def on_engine(self, k: int, call: Callable):
        """`call(client)` on server k, or through the router when there is one. When it fails, the servers are
        health-checked (a dead or hung one restarted, as the rollout group recovers a failed chunk's engine) and the
        call is sent once more if what it went to was replaced meanwhile (by this thread or another)."""
        def target():
            return self.front.client if self.front is not None else self.engines[k]

        used = target()
        try:
            return call(used)
        except self.kit.request_error:
            if self.servers is None:
                raise
            restarted = self.revive()
            if not restarted and target() is used:
                raise
        return call(target())

    def spread(self, n: int, size: int, parallel: int, call: Callable[[object, list[int]], list],
               by: str) -> tuple[list, ScoreResult]:
        """Items 0..n-1 in chunks of `size`, chunk k to server (turn + k) in turn (or the router), `parallel`
        chunks at once: `call(client, indices)` answers one value per index. A chunk whose call fails leaves its
        items without a value, 'timeout' or 'failed' in the result (named `by`), never raised. Behind a router
        every server is health-checked first (the router would quietly route around a dead one)."""
        values: list = [None] * n
        result = ScoreResult.empty(n)
        if not n:
            return values, result
        if self.front is not None:
            self.revive()
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        failures: list[tuple[int, str, str]] = []  # recorded after the threads: the counts are not shared

        def run(k: int) -> None:
            idx = chunks[k]
            try:
                got = self.on_engine((self._turn + k) % len(self.engines), lambda engine: call(engine, idx))
            except self.kit.request_error as e:
                failures.extend((i, TIMEOUT if getattr(e, "timeout", False) else FAILED, str(e)) for i in idx)
                return
            for i, value in zip(idx, got):
                values[i] = value

        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(chunks)))) as pool:
            list(pool.map(run, range(len(chunks))))
        self._turn += len(chunks)
        for i, status, error in sorted(failures):
            result.fail(i, status, by, error)
        return values, result

    def close(self) -> None:
        if self.front is not None:
            try:
                self.front.shutdown()
            except Exception as err:  # noqa: BLE001 - a failing shutdown must not hide what caused it
                log.warning("reward %s %s: router shutdown failed: %s", self.label, self.name, err)
            self.front = None
        if self.servers is not None:
            self.servers.close()
        self.engines = []
