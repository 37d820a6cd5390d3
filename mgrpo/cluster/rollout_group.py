"""Rollout engines as Ray actors: dispatch, progress, health checks, restarts and retries.

Each engine lives in its own Ray actor (`EngineHost`), built by the engine registry
(`mgrpo/rollout/factory.py`); this module knows no engine by name. The driver splits a batch of
requests into chunks, spreads them over the engines and shows progress as chunks finish. While it
waits it health-checks the engines that hold chunks every `rollout.health_check_interval_s`: an engine
that died or stopped answering (`rollout.health_check_timeout_s`) is restarted, brought to the current
weights, and its chunks are sent again. Every retry and restart is counted in the step's metrics; a
chunk's results are taken once, from the attempt that finished, so nothing is lost or duplicated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from tqdm import tqdm

from mgrpo.cluster.placement import Placement
from mgrpo.cluster.trainer_group import dead_nodes
from mgrpo.config import MGRPOConfig, seeds
from mgrpo.rollout.factory import EngineContext, build_engine, engine_spec
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)


@ray.remote
class EngineHost:
    """Hosts one rollout engine (whatever the registry builds for its name)."""

    def __init__(self, name: str, hf_dir: str, kwargs: dict):
        self.engine = build_engine(name, hf_dir, kwargs)

    def generate(self, requests, sampling):
        return self.engine.generate(requests, sampling)

    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors)

    def finish_weight_update(self, version: int):
        self.engine.finish_weight_update(version)

    def health(self):
        return self.engine.health()

    def address(self) -> dict:
        """Where the engine is, for direct weight senders: node, server URL (if any), TP size, and the
        accelerators Ray gave its host."""
        return {"node_ip": ray.util.get_node_ip_address(), "url": getattr(self.engine, "url", None),
                "tp": getattr(self.engine, "tp", 1), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def retries(self) -> int:
        """Requests the engine retried itself (HTTP errors, aborted requests) - for metrics."""
        return int(getattr(self.engine, "retries", 0))

    def release_memory(self, tags=None):
        self.engine.release_memory(tags)

    def resume_memory(self, tags=None):
        self.engine.resume_memory(tags)

    def shutdown(self):
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()


class HostDelivery:
    """Weight buckets through the engines' host actors: one object transfer per bucket, shared by all
    engines (each host then loads it, or hands it to its server from the server's own node)."""

    def __init__(self, handles: list):
        self.handles = handles

    def update_weights(self, bucket) -> None:
        if not self.handles:
            return
        ref = ray.put(bucket)
        ray.get([h.update_weights.remote(ref) for h in self.handles])


class NodeLocalDelivery:
    """A node-local transport (CUDA IPC, shared memory) for the engines on the sending rank's node,
    host delivery for the others. Resolved on the trainer rank at its first bucket, then reused."""

    def __init__(self, cfg: MGRPOConfig, engines: list[tuple[object, dict]], generation: int):
        self.cfg = cfg
        self.engines = engines  # (host handle, EngineHost.address())
        self.generation = generation
        self._split = None

    def update_weights(self, bucket) -> None:
        if self._split is None:
            here = ray.util.get_node_ip_address()
            local = [a for _, a in self.engines if a["node_ip"] == here]
            spec = engine_spec(self.cfg.rollout.engine)
            sender = spec.direct_sender(self.cfg, local, self.generation) if local else None
            self._split = (sender, HostDelivery([h for h, a in self.engines if a["node_ip"] != here]))
        sender, remote = self._split
        if sender is not None:
            sender.update_weights(bucket)
        remote.update_weights(bucket)


@dataclass
class RolloutStats:
    retries: int = 0
    restarts: int = 0
    seconds: float = 0.0
    per_engine: dict = field(default_factory=dict)


class RolloutGroup:
    def __init__(self, cfg: MGRPOConfig, placement: Placement, *, hf_dir: str, context: EngineContext,
                 devices: Optional[list[list[str]]] = None):
        """`devices[i]`: accelerator ids engine i's server must use (colocated on GPUs), else None."""
        self.cfg = cfg
        self.placement = placement
        self.spec = engine_spec(cfg.rollout.engine)
        self.devices = devices
        self._kwargs = [self.spec.kwargs(cfg, EngineContext(**{**context.__dict__,
                                                                "visible_devices": devices[i] if devices else None}))
                        for i in range(cfg.rollout.num_engines)]
        self.hf_dir = hf_dir
        self.engines = [self._start(i) for i in range(cfg.rollout.num_engines)]
        ray.get([e.health.remote() for e in self.engines])  # wait until every engine is up
        self.nodes = [a["node_ip"] for a in ray.get([e.address.remote() for e in self.engines])]
        self.front = None
        """A router in front of several engines (when the engine has one): generation goes through it."""
        if self.spec.front is not None and len(self.engines) > 1:
            self.urls = [a["url"] for a in ray.get([e.address.remote() for e in self.engines])]
            self.front = self.spec.front(cfg, self.urls, context)
        self.weight_version = 0
        self.generation = 0
        """Bumped when an engine restarts: direct senders built for the old engines are stale."""
        self.on_restart: Optional[Callable[[list], None]] = None
        """Set by the weight sync: pushes the current weights to the given engine handles."""
        self.total = RolloutStats()
        self._engine_retries = 0
        self._receivers: Optional[tuple[int, list]] = None

    def _start(self, index: int):
        return EngineHost.options(max_concurrency=4,
                                  **self.placement.engine_options(index, self.cfg.trainer.cpus_per_worker)).remote(
            self.cfg.rollout.engine, self.hf_dir, self._kwargs[index])

    # --- weight receivers -----------------------------------------------------------------------
    def receivers(self, engines: Optional[list] = None) -> list:
        """What the trainer ranks push weight buckets through, to all engines (built once and reused
        until an engine restarts) or to the given ones (a restarted engine catching up)."""
        if engines is None and self._receivers is not None and self._receivers[0] == self.generation:
            return self._receivers[1]
        handles = engines if engines is not None else self.engines
        out = self._build_receivers(handles)
        if engines is None:
            self._receivers = (self.generation, out)
        return out

    def _build_receivers(self, handles: list) -> list:
        if self.spec.direct_sender is None:
            return [HostDelivery(handles)]
        addresses = ray.get([h.address.remote() for h in handles])
        if self.spec.node_local(self.cfg):
            return [NodeLocalDelivery(self.cfg, list(zip(handles, addresses)), self.generation)]
        return [self.spec.direct_sender(self.cfg, addresses, self.generation)]

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, desc: str = "rollout"
                 ) -> tuple[list[GenerateResult], RolloutStats]:
        """n samples per prompt; result i*n + j is sample j of prompt i."""
        r = self.cfg.rollout
        requests = [GenerateRequest(uid=i * n + j, prompt_ids=p) for i, p in enumerate(prompts) for j in range(n)]
        size = r.generate_chunk
        if self.front is not None:  # a router places each request it gets: give it enough to spread
            size = max(1, min(size, -(-len(requests) // (2 * len(self.engines)))))
        chunks = [requests[k:k + size] for k in range(0, len(requests), size)]
        params = [SamplingParams(**{**sampling.__dict__, "seed": seeds.chunk_seed(sampling.seed, k)})
                  for k in range(len(chunks))]
        stats = RolloutStats()
        t0 = time.perf_counter()
        pending: dict = {}  # ObjectRef -> (chunk index, engine index, attempt)

        def send(k: int, e: int, attempt: int) -> None:
            pending[self.engines[e].generate.remote(chunks[k], params[k])] = (k, e, attempt)

        def retry(k: int, e: int, attempt: int, why: str) -> None:
            if attempt >= r.max_retries:
                raise RuntimeError(f"rollout chunk {k} failed {attempt + 1} times (rollout.max_retries="
                                   f"{r.max_retries}); last error: {why}")
            log.warning("rollout engine %d: %s; retrying chunk %d", e, why, k)
            stats.retries += 1
            send(k, e, attempt + 1)

        results: dict[int, list[GenerateResult]] = {}
        if self.front is not None:
            self._generate_via_front(chunks, params, results, stats, desc, len(requests))
            return self._finish_generate(results, stats, t0)
        for k in range(len(chunks)):
            send(k, k % len(self.engines), 0)
        last_check = time.monotonic()
        with tqdm(total=len(requests), desc=desc, unit="sample", leave=False, dynamic_ncols=True,
                  disable=None) as bar:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=r.health_check_interval_s)
                if done:
                    k, e, attempt = pending.pop(done[0])
                    try:
                        out = ray.get(done[0])
                    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                        if not self._alive(e):
                            self._restart(e)
                            stats.restarts += 1
                        retry(k, e, attempt, f"{type(err).__name__}: {err}")
                        continue
                    results[k] = out
                    stats.per_engine[e] = stats.per_engine.get(e, 0) + len(out)
                    bar.update(len(out))
                if time.monotonic() - last_check >= r.health_check_interval_s:
                    last_check = time.monotonic()
                    stats.restarts += self._recover_busy(pending, retry)
        return self._finish_generate(results, stats, t0)

    def _finish_generate(self, results: dict, stats: RolloutStats, t0: float):
        # Retries the engines' clients did themselves (HTTP errors, aborted requests) count as well.
        engine_retries = sum(ray.get([e.retries.remote() for e in self.engines]))
        if self.front is not None:
            engine_retries += self.front.retries
        stats.retries += max(engine_retries - self._engine_retries, 0)
        self._engine_retries = engine_retries
        stats.seconds = time.perf_counter() - t0
        self.total.retries += stats.retries
        self.total.restarts += stats.restarts
        return sorted((x for k in sorted(results) for x in results[k]), key=lambda x: x.uid), stats

    def _generate_via_front(self, chunks, params, results: dict, stats: RolloutStats, desc: str, total: int) -> None:
        """Every chunk through the router (which picks an engine per request). A chunk that fails is resent
        after the engines were health-checked (and the dead or hung ones restarted and re-registered)."""
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        r = self.cfg.rollout
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(chunks), 4 * len(self.engines))),
                                  thread_name_prefix="mgrpo-rollout")
        pending = {pool.submit(self.front.generate, chunks[k], params[k]): (k, 0) for k in range(len(chunks))}
        last_check = time.monotonic()
        try:
            with tqdm(total=total, desc=desc, unit="sample", leave=False, dynamic_ncols=True, disable=None) as bar:
                while pending:
                    done, _ = wait(list(pending), timeout=r.health_check_interval_s, return_when=FIRST_COMPLETED)
                    for fut in done:
                        k, attempt = pending.pop(fut)
                        try:
                            results[k] = fut.result()
                        except Exception as err:  # noqa: BLE001 - counted, retried, raised when out of retries
                            if attempt >= r.max_retries:
                                raise RuntimeError(f"rollout chunk {k} failed {attempt + 1} times through the router "
                                                   f"(rollout.max_retries={r.max_retries}): {err}") from err
                            log.warning("rollout chunk %d failed through the router (%s); checking engines", k, err)
                            stats.restarts += self.health_check()
                            stats.retries += 1
                            pending[pool.submit(self.front.generate, chunks[k], params[k])] = (k, attempt + 1)
                            continue
                        bar.update(len(results[k]))
                    if time.monotonic() - last_check >= r.health_check_interval_s:
                        last_check = time.monotonic()
                        stats.restarts += self.health_check()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _recover_busy(self, pending: dict, retry) -> int:
        """Health-check the engines that hold chunks; restart a dead or hung one and resend its chunks
        (their old futures are dropped, so a late answer from the old engine is never taken)."""
        restarted = 0
        for e in sorted({e for _, e, _ in pending.values()}):
            if self._alive(e):
                continue
            lost = [(ref, v) for ref, v in pending.items() if v[1] == e]
            for ref, _ in lost:
                del pending[ref]
            self._restart(e)
            restarted += 1
            for _, (k, _, attempt) in lost:
                retry(k, e, attempt, "engine failed its health check")
        return restarted

    # --- weights and health ---------------------------------------------------------------------
    def finish_weight_update(self, version: int) -> None:
        ray.get([e.finish_weight_update.remote(version) for e in self.engines])
        self.weight_version = version

    def _alive(self, index: int) -> bool:
        try:
            health = ray.get(self.engines[index].health.remote(), timeout=self.cfg.rollout.health_check_timeout_s)
            return bool(health.ok)
        except Exception:  # dead actor, timeout, or an engine reporting an error
            return False

    def _node_lost(self, index: int, wait_s: float) -> None:
        """Raise, naming the node, if engine `index`'s node left the cluster (its bundle has nowhere to go)."""
        if self.nodes[index] in dead_nodes(wait_s):
            raise RuntimeError(f"rollout engine {index} was on node {self.nodes[index]}, which left the Ray "
                               "cluster; run again with trainer.resume=auto to continue from the last checkpoint")

    def _restart(self, index: int) -> None:
        self._node_lost(index, wait_s=0.0)
        log.warning("restarting rollout engine %d", index)
        self._stop(self.engines[index])
        try:
            ray.kill(self.engines[index])
        except Exception:
            pass
        self.engines[index] = self._start(index)
        self.generation += 1
        ready, deadline = self.engines[index].health.remote(), time.monotonic() + self.cfg.rollout.request_timeout_s
        while not ray.wait([ready], timeout=5.0)[0]:  # a node declared dead meanwhile ends the wait
            self._node_lost(index, wait_s=0.0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout engine {index} did not come back within rollout.request_timeout_s="
                                   f"{self.cfg.rollout.request_timeout_s}")
        ray.get(ready)
        self.nodes[index] = ray.get(self.engines[index].address.remote())["node_ip"]
        if self.front is not None:
            new_url = ray.get(self.engines[index].address.remote())["url"]
            self.front.replace(self.urls[index], new_url)
            self.urls[index] = new_url
        if self.on_restart is not None and self.weight_version > 0:
            self.on_restart([self.engines[index]])
            ray.get(self.engines[index].finish_weight_update.remote(self.weight_version))

    def health_check(self) -> int:
        """Restart every engine that does not answer; return how many were restarted."""
        restarted = 0
        for i in range(len(self.engines)):
            if not self._alive(i):
                self._restart(i)
                restarted += 1
        self.total.restarts += restarted
        return restarted

    def release_memory(self, tags=None) -> int:
        """Colocated engines free their accelerator memory; returns how many engines had to be restarted
        (one that died since its last request is restarted here, not left to fail the next phase)."""
        return self._on_each("release_memory", tags)

    def resume_memory(self, tags=None) -> int:
        return self._on_each("resume_memory", tags)

    def _on_each(self, method: str, *args) -> int:
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        restarted = 0
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                if self._alive(i):
                    raise
                log.warning("rollout engine %d failed during %s (%s); restarting it", i, method, err)
                self._restart(i)
                restarted += 1
                ray.get(getattr(self.engines[i], method).remote(*args))
        self.total.restarts += restarted
        return restarted

    def _stop(self, engine) -> None:
        """Let the engine stop what it owns (a server) before its actor is killed."""
        try:
            ray.get(engine.shutdown.remote(), timeout=self.cfg.rollout.health_check_timeout_s)
        except Exception:  # a dead or hung engine has nothing left to stop politely
            pass

    def shutdown(self) -> None:
        if self.front is not None:
            self.front.shutdown()
        for e in self.engines:
            self._stop(e)
            ray.kill(e)
