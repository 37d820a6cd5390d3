"""Rollout engines as Ray actors: dispatch, progress, health checks, restarts and retries.

Each engine lives in a host process (`mgrpo/cluster/engine_host.py`): an `EngineHost` actor of its
own, or, with rollout.mode=hybrid, a Megatron rank. The engine registry (`mgrpo/rollout/factory.py`)
builds it; this module knows no engine by name. The driver splits a batch of
requests into chunks, spreads them over the engines and shows progress as chunks finish. While it
waits it health-checks the engines that hold chunks every `rollout.health_check_interval_s`: an engine
that died or stopped answering (`rollout.health_check_timeout_s`) is restarted, brought to the current
weights, and its chunks are sent again. Every retry and restart is counted in the step's metrics; a
chunk's results are taken once, from the attempt that finished, so nothing is lost or duplicated.

Every engine server and the router require the run's secret (`rollout.api_key`, resolved here once per
run and handed to the engines and weight senders); requests they refused for a missing or wrong key are
counted in `rollout/auth_refused`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from tqdm import tqdm

from mgrpo.cluster.engine_host import EngineHost, HostDelivery, host_alive, stop_host
from mgrpo.cluster.placement import Placement
from mgrpo.cluster.engine_dispatch import ToEngines, ViaRouter, session_engine
from mgrpo.cluster.megatron_group import dead_nodes
from mgrpo.config import MGRPOConfig, seeds
from mgrpo.rollout.factory import EngineContext, engine_spec, resolve_api_key
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)


class NodeLocalDelivery:
    """A node-local transport (CUDA IPC, shared memory) for the engines on the sending rank's node,
    host delivery for the others. Resolved on the Megatron rank at its first bucket, then reused."""

    def __init__(self, cfg: MGRPOConfig, engines: list[tuple[object, dict]], generation: int,
                 api_key: Optional[str] = None):
        self.cfg = cfg
        self.engines = engines  # (host handle, EngineSlot.address())
        self.generation = generation
        self.api_key = api_key
        self._split = None

    def update_weights(self, bucket) -> None:
        if self._split is None:
            here = ray.util.get_node_ip_address()
            local = [a for _, a in self.engines if a["node_ip"] == here]
            spec = engine_spec(self.cfg.rollout.engine)
            sender = spec.direct_sender(self.cfg, local, self.generation, self.api_key) if local else None
            remote = [(h, a) for h, a in self.engines if a["node_ip"] != here]
            self._split = (sender, HostDelivery([h for h, _ in remote], [a["actor_id"] for _, a in remote]))
        sender, remote = self._split
        if sender is not None:
            sender.update_weights(bucket)
        remote.update_weights(bucket)


@dataclass
class RolloutStats:
    retries: int = 0
    restarts: int = 0
    auth_refused: int = 0
    """Requests the engines' servers and the router refused for a missing or wrong key since the last call."""
    seconds: float = 0.0
    per_engine: dict = field(default_factory=dict)


class RolloutGroup:
    def __init__(self, cfg: MGRPOConfig, placement: Placement, *, hf_dir: str, context: EngineContext,
                 devices: Optional[list[list[str]]] = None, hosts: Optional[list] = None):
        """`devices[i]`: accelerator ids engine i's server must use (colocated on GPUs), else None.
        `hosts[i]`: the Megatron rank that hosts engine i (rollout.mode=hybrid), else None (own processes)."""
        self.cfg = cfg
        self.hosts = hosts
        self.placement = placement
        self.spec = engine_spec(cfg.rollout.engine)
        self.devices = devices
        self.api_key = resolve_api_key(cfg)
        if self.api_key is None:
            log.warning("rollout.api_key=none: the rollout servers and the router accept requests without a key; "
                        "anyone who can reach their ports can replace the model or its memory")
        self._kwargs = [self.spec.kwargs(cfg, EngineContext(**{**context.__dict__, "api_key": self.api_key,
                                                                "visible_devices": devices[i] if devices else None}))
                        for i in range(cfg.rollout.num_engines)]
        self.hf_dir = hf_dir
        self.engines = [self._start(i) for i in range(cfg.rollout.num_engines)]
        ray.get([e.health.remote() for e in self.engines])  # wait until every engine is up
        self.addresses = ray.get([e.address.remote() for e in self.engines])
        """`EngineSlot.address()` of each engine: node, URL, host actor, whether it releases memory."""
        self.front = None
        """A router in front of several engines (when the engine has one): generation goes through it."""
        if self.spec.front is not None and len(self.engines) > 1:
            self.front = self.spec.front(cfg, [a["url"] for a in self.addresses],
                                         EngineContext(**{**context.__dict__, "api_key": self.api_key}))
        self.weight_version = 0
        self.generation = 0
        """Bumped when an engine restarts: direct senders built for the old engines are stale."""
        self.on_restart: Optional[Callable[[list], None]] = None
        """Set by the weight sync: pushes the current weights to the given engine handles."""
        self._engine_retries = 0
        self._refused: dict[str, int] = {}
        self._refusal_asks: Optional[tuple] = None
        self._refusal_lock = threading.Lock()
        self._heal_lock = threading.RLock()
        """`generate` may run in several threads at once (multi-turn rollouts send each ready turn without
        waiting for the calls in flight): one at a time decides whether an engine is dead and restarts it, so
        two calls that saw the same failure restart it once, and the retry counts are read once."""
        self._front_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgrpo-refusals")
        self._receivers: Optional[tuple[int, list]] = None

    @property
    def urls(self) -> list:
        """The engines' server URLs (None for an engine without a server)."""
        return [a["url"] for a in self.addresses]

    def _start(self, index: int):
        if self.hosts is not None:  # hybrid: the engine moves into its Megatron rank's process
            ray.get(self.hosts[index].start_engine.remote(self.cfg.rollout.engine, self.hf_dir, self._kwargs[index]))
            return self.hosts[index]
        return EngineHost.options(**self.placement.engine_options(index, self.cfg.trainer.cpus_per_worker)).remote(
            self.cfg.rollout.engine, self.hf_dir, self._kwargs[index])

    # --- weight receivers -----------------------------------------------------------------------
    def receivers(self, engines: Optional[list] = None) -> list:
        """What the Megatron ranks push weight buckets through, to all engines (built once and reused
        until an engine restarts) or to the given ones (a restarted engine catching up)."""
        if engines is None and self._receivers is not None and self._receivers[0] == self.generation:
            return self._receivers[1]
        handles = engines if engines is not None else self.engines
        out = self._build_receivers(handles)
        if engines is None:
            self._receivers = (self.generation, out)
        return out

    def _build_receivers(self, handles: list) -> list:
        addresses = [self.addresses[self.engines.index(h)] for h in handles]
        if self.spec.direct_sender is None:
            return [HostDelivery(handles, [a["actor_id"] for a in addresses])]
        if self.spec.node_local(self.cfg):
            return [NodeLocalDelivery(self.cfg, list(zip(handles, addresses)), self.generation, self.api_key)]
        return [self.spec.direct_sender(self.cfg, addresses, self.generation, self.api_key)]

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, desc: str = "rollout",
                 sessions: Optional[list[str]] = None, request_seeds: Optional[list[int]] = None,
                 routes_from: Optional[list[int]] = None) -> tuple[list[GenerateResult], RolloutStats]:
        """n samples per prompt; result i*n + j is sample j of prompt i. `sessions` (one per prompt, n=1: the
        turns of multi-turn trajectories): the requests of one session go to one engine, for its prefix cache.

        The requests go out in chunks, to the engines in turn or through the router, and come back as
        futures. One loop waits for them: a chunk that fails is sent again (at most rollout.max_retries
        times, each counted) after the engines were checked, and while it waits the loop health-checks
        the engines every rollout.health_check_interval_s, restarting a dead or hung one. `request_seeds` (one per
        prompt, n=1): each request's own sampling seed (`GenerateRequest.seed`), which no chunking changes.
        `routes_from` (one per prompt, n=1): SGLang's routed_experts_start_len of each request
        (`GenerateRequest.routes_from`). Routed experts never go through the router: sglang-router 0.3.2 drops
        return_routed_experts, so such calls go to the engines directly (sessions by the group's own hash)."""
        r = self.cfg.rollout
        if sessions is not None and (n != 1 or len(sessions) != len(prompts)):
            raise ValueError(f"sessions: one per prompt with n=1, got {len(sessions)} for {len(prompts)} x n={n}")
        if request_seeds is not None and (n != 1 or len(request_seeds) != len(prompts)):
            raise ValueError(f"request_seeds: one per prompt with n=1, got {len(request_seeds)} for {len(prompts)} "
                             f"x n={n}")
        if routes_from is not None and (n != 1 or len(routes_from) != len(prompts)):
            raise ValueError(f"routes_from: one per prompt with n=1, got {len(routes_from)} for {len(prompts)} x n={n}")
        requests = [GenerateRequest(uid=i * n + j, prompt_ids=p, session=sessions[i] if sessions else None,
                                    seed=request_seeds[i] if request_seeds is not None else None,
                                    routes_from=routes_from[i] if routes_from is not None else 0)
                    for i, p in enumerate(prompts) for j in range(n)]
        front = None if sampling.return_routed_experts else self.front
        size = r.generate_chunk
        if front is not None:  # a router places each request it gets: give it enough to spread
            size = max(1, min(size, -(-len(requests) // (2 * len(self.engines)))))
        home: Optional[list[int]] = None  # chunk -> the engine its sessions live on
        if sessions is not None and front is None:
            by_engine: dict[int, list[GenerateRequest]] = {}
            for q in requests:
                by_engine.setdefault(session_engine(q.session, len(self.engines)), []).append(q)
            chunks, home = [], []
            for e, qs in sorted(by_engine.items()):
                for k in range(0, len(qs), size):
                    chunks.append(qs[k:k + size])
                    home.append(e)
        else:
            chunks = [requests[k:k + size] for k in range(0, len(requests), size)]
        params = [SamplingParams(**{**sampling.__dict__, "seed": seeds.chunk_seed(sampling.seed, k)})
                  for k in range(len(chunks))]
        stats, t0 = RolloutStats(), time.perf_counter()
        route = ViaRouter(self, chunks, params) if front is not None else ToEngines(self, chunks, params, home)
        pending: dict[Future, tuple[int, Optional[int], int]] = {}  # future -> (chunk, engine or None, attempt)

        def send(k: int, attempt: int, engine: Optional[int] = None) -> None:
            future, e = route.send(k, engine)
            pending[future] = (k, e, attempt)

        def retry(k: int, e: Optional[int], attempt: int, why: str) -> None:
            if attempt >= r.max_retries:
                raise RuntimeError(f"rollout chunk {k} failed {attempt + 1} times{route.where} (rollout.max_retries="
                                   f"{r.max_retries}); last error: {why}")
            log.warning("rollout chunk %d failed%s (%s); sending it again", k, route.where, why)
            stats.retries += 1
            send(k, attempt + 1, e)

        results: dict[int, list[GenerateResult]] = {}
        for k in range(len(chunks)):
            send(k, 0)
        last_check = time.monotonic()
        try:
            with tqdm(total=len(requests), desc=desc, unit="sample", leave=False, dynamic_ncols=True,
                      disable=None) as bar:
                while pending:
                    done, _ = wait(list(pending), timeout=r.health_check_interval_s, return_when=FIRST_COMPLETED)
                    for future in done:
                        k, e, attempt = pending.pop(future)
                        try:
                            out = future.result()
                        except route.retryable as err:
                            stats.restarts += route.recover(e)
                            retry(k, e, attempt, f"{type(err).__name__}: {err}")
                            continue
                        results[k] = out
                        for x in out:
                            x.engine = "router" if e is None else e
                        if e is not None:
                            stats.per_engine[e] = stats.per_engine.get(e, 0) + len(out)
                        bar.update(len(out))
                    if time.monotonic() - last_check >= r.health_check_interval_s:
                        last_check = time.monotonic()
                        stats.restarts += route.check(pending, retry)
        finally:
            route.close()
        return self._finish_generate(results, stats, t0)

    def _refusals_since_last(self) -> int:
        """Requests refused for a missing or wrong key since the last call, summed over the engines' servers
        and the router (servers that do not count them, like SGLang's own, add nothing). The counts are
        asked for now and read at the next call, so no generation waits on them: a call reports what was
        refused up to the end of the previous one."""
        with self._refusal_lock:  # the asynchronous pipeline generates from a thread of its own
            return self._refusals_locked()

    def _refusals_locked(self) -> int:
        asked, self._refusal_asks = self._refusal_asks, (
            [(a["url"], e.refused_requests.remote()) for e, a in zip(self.engines, self.addresses) if a["url"]],
            self._front_pool.submit(self.front.refused_requests) if self.front is not None else None)
        if asked is None:
            return 0
        counts = {}  # by server URL (a restarted engine has a new one and counts from 0) and the router
        for url, ref in asked[0]:
            try:
                counts[url] = ray.get(ref)
            except ray.exceptions.RayError:  # the engine died meanwhile: its replacement reports next time
                pass
        if asked[1] is not None:
            counts["router"] = asked[1].result()
        fresh = sum(max((c or 0) - self._refused.get(k, 0), 0) for k, c in counts.items())
        self._refused.update({k: c or 0 for k, c in counts.items()})
        return fresh

    def _finish_generate(self, results: dict, stats: RolloutStats, t0: float):
        # Retries the engines' clients did themselves (HTTP errors, aborted requests) count as well.
        with self._heal_lock:
            engine_retries = sum(ray.get([e.retries.remote() for e, a in zip(self.engines, self.addresses)
                                          if a["counts_retries"]]))
            if self.front is not None:
                engine_retries += self.front.retries
            stats.retries += max(engine_retries - self._engine_retries, 0)
            self._engine_retries = engine_retries
        stats.auth_refused = self._refusals_since_last()
        stats.seconds = time.perf_counter() - t0
        return sorted((x for k in sorted(results) for x in results[k]), key=lambda x: x.uid), stats

    # --- weights and health ---------------------------------------------------------------------
    def load_adapter(self, name: str, tensors: dict, config: dict, version: int,
                     engines: Optional[list] = None) -> int:
        """A LoRA adapter into every engine (or the given ones) under `name`, which their generate requests (and
        the router's) name from now on, the previous one unloaded, the engines' weight version `version`;
        returns the bytes of one copy."""
        sent = ray.get([e.use_lora_adapter.remote(name, tensors, config, version)
                        for e in (engines if engines is not None else self.engines)])
        if self.front is not None:
            self.front.client.lora_name = name
        if engines is None:
            self.weight_version = version
        return max(sent, default=0)

    def finish_weight_update(self, version: int, done: bool = False) -> None:
        """Close the update on every engine (`done`: the sending rank already has)."""
        if not done:
            ray.get([e.finish_weight_update.remote(version) for e in self.engines])
        self.weight_version = version

    def _alive(self, index: int) -> bool:
        return host_alive(self.engines[index], self.cfg.rollout.health_check_timeout_s)

    def _node_lost(self, index: int, wait_s: float) -> None:
        """Raise, naming the node, if engine `index`'s node left the cluster (its bundle has nowhere to go)."""
        node = self.addresses[index]["node_ip"]
        if node in dead_nodes(wait_s):
            raise RuntimeError(f"rollout engine {index} was on node {node}, which left the Ray "
                               "cluster; run again with trainer.resume=auto to continue from the last checkpoint")

    def _restart(self, index: int) -> None:
        self._node_lost(index, wait_s=0.0)
        log.warning("restarting rollout engine %d", index)
        # a hybrid engine's host is a Megatron rank: only the engine is replaced
        stop_host(self.engines[index], self.cfg.rollout.health_check_timeout_s, kill=self.hosts is None)
        try:
            self.engines[index] = self._start(index)
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"rollout engine {index} cannot be restarted: its host, Megatron rank "
                               f"{self.cfg.rollout.tp * index} (rollout.mode=hybrid), died; run again with "
                               "trainer.resume=auto to continue from the last checkpoint") from err
        self.generation += 1
        ready, deadline = self.engines[index].health.remote(), time.monotonic() + self.cfg.rollout.request_timeout_s
        while not ray.wait([ready], timeout=5.0)[0]:  # a node declared dead meanwhile ends the wait
            self._node_lost(index, wait_s=0.0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout engine {index} did not come back within rollout.request_timeout_s="
                                   f"{self.cfg.rollout.request_timeout_s}")
        ray.get(ready)
        old_url, self.addresses[index] = self.addresses[index]["url"], ray.get(self.engines[index].address.remote())
        if self.front is not None and self.front.alive(self.cfg.rollout.health_check_timeout_s):
            self.front.replace(old_url, self.addresses[index]["url"])  # (a dead one restarts with the new URL)
        if self.on_restart is not None and self.weight_version > 0:
            self.on_restart([self.engines[index]])
            ray.get(self.engines[index].finish_weight_update.remote(self.weight_version))

    def health_check(self) -> int:
        """Restart every engine that does not answer, then the router in front of them if it died or
        hangs (started again in front of the engines' current servers); return how many processes were
        restarted. A hybrid engine without a server is objects inside its Megatron rank, alive exactly
        while the rank is (which the trainer's own calls find out): it is not asked."""
        with self._heal_lock:
            restarted = 0
            for i in range(len(self.engines)):
                if self.hosts is not None and self.addresses[i]["url"] is None:
                    continue
                if not self._alive(i):
                    self._restart(i)
                    restarted += 1
            if self.front is not None and not self.front.alive(self.cfg.rollout.health_check_timeout_s):
                self.front.restart(self.urls)
                restarted += 1
            return restarted

    def abort_all(self) -> int:
        """Cut every engine's requests in flight (rollout.over_sample_rate: SGLang's /abort_request with
        abort_all); their answers come back as finish_reason 'abort', not retried. Returns how many engines cut
        (an engine that cannot, like the in-process one, finishes its calls instead). Bounded: an engine that
        does not answer within rollout.health_check_timeout_s is left to the health checks."""
        refs = [e.abort_all.remote() for e in self.engines]
        cut = 0
        for ref in refs:
            try:
                cut += bool(ray.get(ref, timeout=self.cfg.rollout.health_check_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as err:
                log.warning("rollout engine did not take the long-tail abort (%s: %s)", type(err).__name__, err)
        return cut

    def release_memory(self, tags=None) -> int:
        """Colocated engines free their accelerator memory; returns how many engines had to be restarted
        (one that died since its last request is restarted here, not left to fail the next phase)."""
        return self._on_each("release_memory", tags)

    def resume_memory(self, tags=None) -> int:
        return self._on_each("resume_memory", tags)

    def _on_each(self, method: str, *args) -> int:
        """A memory call on every engine that has accelerator memory to release (an engine on the CPU has
        none: it is not called, which spares a round trip per step)."""
        refs = {i: getattr(e, method).remote(*args) for i, e in enumerate(self.engines)
                if self.addresses[i]["releases_memory"]}
        restarted = 0
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                if self._alive(i):
                    raise
                log.warning("rollout engine %d failed during %s (%s); restarting it", i, method, err)
                self._restart(i)
                restarted += 1
                ray.get(getattr(self.engines[i], method).remote(*args))
        return restarted

    def shutdown(self) -> None:
        self._front_pool.shutdown(wait=False, cancel_futures=True)
        if self.front is not None:
            self.front.shutdown()
        for e in self.engines:  # hybrid hosts are Megatron ranks: the Megatron group takes them down
            stop_host(e, self.cfg.rollout.health_check_timeout_s, kill=self.hosts is None)
