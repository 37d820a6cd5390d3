"""Rollout engines as Ray actors: dispatch, progress, retries, health checks, restarts.

Each engine lives in its own Ray actor (`EngineHost`). The driver splits a batch of requests into
chunks, spreads them over the engines, shows progress as chunks finish, and retries a chunk whose
engine died on a restarted engine that first gets the current weights again. Every retry and
restart is counted and reported in the step's metrics.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from tqdm import tqdm

from mgrpo.cluster.ray_env import Bundles
from mgrpo.config import MGRPOConfig
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)


@ray.remote
class EngineHost:
    """Hosts one rollout engine. On CPU: the in-process transformers engine. On GPU: an SGLang server
    launched and owned by this actor, reached over HTTP."""

    def __init__(self, kind: str, hf_dir: str, eos_token_ids: list[int], pad_token_id: int, chunk_size: int,
                 num_threads: int, engine_kwargs: Optional[dict] = None):
        self.kind = kind
        if kind == "hf":
            from mgrpo.rollout.hf_engine import HFRolloutEngine

            self.engine = HFRolloutEngine(hf_dir, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                          chunk_size=chunk_size, num_threads=num_threads)
        else:
            from mgrpo.rollout.sglang import SGLangEngine

            kwargs = dict(engine_kwargs or {})
            # Bind to the address of the node this actor landed on (never 0.0.0.0).
            kwargs.setdefault("host", ray.util.get_node_ip_address())
            self.engine = SGLangEngine.launch(hf_dir, **kwargs)

    def generate(self, requests, sampling):
        return self.engine.generate(requests, sampling)

    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors)

    def finish_weight_update(self, version: int):
        self.engine.finish_weight_update(version)

    def health(self):
        return self.engine.health()

    def address(self) -> dict:
        """Where the engine is: its node and (SGLang) URL and TP size, for direct weight senders."""
        return {"node_ip": ray.util.get_node_ip_address(), "url": getattr(self.engine, "url", None),
                "tp": getattr(self.engine, "tp", 1)}

    def retries(self) -> int:
        """Requests the engine retried itself (HTTP errors, aborted requests) - for metrics."""
        return int(getattr(self.engine, "retries", 0))

    def release_memory(self, tags=None):
        if tags is None:
            self.engine.release_memory()
        else:
            self.engine.release_memory(tags)

    def resume_memory(self, tags=None):
        if tags is None:
            self.engine.resume_memory()
        else:
            self.engine.resume_memory(tags)

    def shutdown(self):
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()


class EngineReceiver:
    """What a trainer rank holds to push weight buckets to engines hosted in Ray actors: one object
    transfer per bucket, shared by all engines (the engine host then loads it, or for SGLang hands
    it to its server over CUDA IPC from the engine's own node)."""

    def __init__(self, handles: list):
        self.handles = handles

    def update_weights(self, bucket) -> None:
        if not self.handles:
            return
        ref = ray.put(bucket)
        ray.get([h.update_weights.remote(ref) for h in self.handles])


class ColocatedSGLangReceiver:
    """Colocated SGLang: engines on the sending rank's node get CUDA IPC handles straight from the
    trainer's memory; engines on other nodes (IPC is intra-node) get the bucket through Ray."""

    def __init__(self, engines: list[tuple[object, dict]]):
        self.engines = engines  # (actor handle, EngineHost.address())
        self._split = None

    def update_weights(self, bucket) -> None:
        if self._split is None:
            from mgrpo.rollout.sglang import IPCWeightSender

            here = ray.util.get_node_ip_address()
            local = [a for _, a in self.engines if a["node_ip"] == here]
            self._split = (IPCWeightSender([a["url"] for a in local], [a["tp"] for a in local]) if local else None,
                           EngineReceiver([h for h, a in self.engines if a["node_ip"] != here]))
        ipc, remote = self._split
        if ipc is not None:
            ipc.update_weights(bucket)
        remote.update_weights(bucket)


@dataclass
class RolloutStats:
    retries: int = 0
    restarts: int = 0
    seconds: float = 0.0
    per_engine: dict = field(default_factory=dict)


class RolloutGroup:
    def __init__(self, cfg: MGRPOConfig, bundles: Bundles, *, hf_dir: str, eos_token_ids: list[int],
                 pad_token_id: int, log_dir: Optional[str] = None):
        self.cfg = cfg
        self.bundles = bundles
        self.hf_dir = hf_dir
        r = cfg.rollout
        engine_kwargs = None
        if r.engine == "sglang":
            engine_kwargs = dict(tp=r.tp, mem_fraction_static=r.gpu_memory_utilization, stop_token_ids=list(eos_token_ids),
                                 max_retries=r.max_retries, request_timeout_s=r.request_timeout_s,
                                 log_dir=os.path.join(log_dir, "sglang") if log_dir else None,
                                 enable_memory_saver=r.mode == "colocated")
        self._host_args = (r.engine, hf_dir, list(eos_token_ids), pad_token_id, r.generate_chunk,
                           cfg.trainer.cpus_per_worker, engine_kwargs)
        self.engines = [self._start(i) for i in range(cfg.rollout.num_engines)]
        ray.get([e.health.remote() for e in self.engines])  # wait until every engine is up
        self.weight_version = 0
        self.on_restart: Optional[Callable[[list], None]] = None
        """Set by the loop: pushes the current weights to the given engine handles."""
        self.total = RolloutStats()
        self._engine_retries = 0

    def _start(self, index: int):
        gpus = self.cfg.rollout.tp if self.cfg.trainer.device == "cuda" else 0
        return EngineHost.options(num_cpus=self.cfg.trainer.cpus_per_worker, num_gpus=gpus,
                                  scheduling_strategy=self.bundles.strategy(index),
                                  max_concurrency=2).remote(*self._host_args)

    def receivers(self, engines: Optional[list] = None) -> list:
        """Objects the trainer ranks push weight buckets through (to all engines, or the given ones):
        through Ray for the transformers engine; CUDA IPC (colocated) or an NCCL broadcast
        (disaggregated) for SGLang."""
        handles = engines if engines is not None else self.engines
        r = self.cfg.rollout
        if r.engine != "sglang":
            return [EngineReceiver(handles)]
        addresses = ray.get([h.address.remote() for h in handles])
        if r.mode == "colocated":
            return [ColocatedSGLangReceiver(list(zip(handles, addresses)))]
        from mgrpo.rollout.sglang import DistributedWeightSender

        return [DistributedWeightSender([a["url"] for a in addresses], [a["tp"] for a in addresses], backend="nccl")]

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, desc: str = "rollout"
                 ) -> tuple[list[GenerateResult], RolloutStats]:
        """n samples per prompt; result i*n + j is sample j of prompt i."""
        requests = [GenerateRequest(uid=i * n + j, prompt_ids=p) for i, p in enumerate(prompts) for j in range(n)]
        size = self.cfg.rollout.generate_chunk
        chunks = [requests[k:k + size] for k in range(0, len(requests), size)]
        params = [SamplingParams(**{**sampling.__dict__, "seed": None if sampling.seed is None else sampling.seed + k})
                  for k in range(len(chunks))]
        stats = RolloutStats()
        t0 = time.perf_counter()
        pending = {}  # ObjectRef -> (chunk index, engine index, attempt)
        for k in range(len(chunks)):
            e = k % len(self.engines)
            pending[self.engines[e].generate.remote(chunks[k], params[k])] = (k, e, 0)
        results: list[GenerateResult] = []
        with tqdm(total=len(requests), desc=desc, unit="sample", leave=False, dynamic_ncols=True,
                  disable=None) as bar:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=self.cfg.rollout.request_timeout_s)
                if not done:
                    raise TimeoutError(f"no rollout chunk finished within rollout.request_timeout_s="
                                       f"{self.cfg.rollout.request_timeout_s}")
                ref = done[0]
                k, e, attempt = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                    if attempt >= self.cfg.rollout.max_retries:
                        raise RuntimeError(f"rollout chunk {k} failed {attempt + 1} times; last error: {err}") from err
                    log.warning("rollout engine %d failed (%s); restarting it and retrying chunk %d", e, err, k)
                    stats.retries += 1
                    if not self._alive(e):
                        self._restart(e)
                        stats.restarts += 1
                    pending[self.engines[e].generate.remote(chunks[k], params[k])] = (k, e, attempt + 1)
                    continue
                results.extend(out)
                stats.per_engine[e] = stats.per_engine.get(e, 0) + len(out)
                bar.update(len(out))
        # Retries the engines did themselves (HTTP errors, aborted requests) count as well.
        engine_retries = sum(ray.get([e.retries.remote() for e in self.engines]))
        stats.retries += max(engine_retries - self._engine_retries, 0)
        self._engine_retries = engine_retries
        stats.seconds = time.perf_counter() - t0
        self.total.retries += stats.retries
        self.total.restarts += stats.restarts
        return sorted(results, key=lambda r: r.uid), stats

    # --- weights and health ---------------------------------------------------------------------
    def finish_weight_update(self, version: int) -> None:
        ray.get([e.finish_weight_update.remote(version) for e in self.engines])
        self.weight_version = version

    def _alive(self, index: int) -> bool:
        try:
            return bool(ray.get(self.engines[index].health.remote(), timeout=30).ok)
        except Exception:  # dead actor, timeout, or an engine reporting an error
            return False

    def _restart(self, index: int) -> None:
        self._stop(self.engines[index])
        try:
            ray.kill(self.engines[index])
        except Exception:
            pass
        self.engines[index] = self._start(index)
        ray.get(self.engines[index].health.remote())
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

    def release_memory(self, tags=None) -> None:
        ray.get([e.release_memory.remote(tags) for e in self.engines])

    def resume_memory(self, tags=None) -> None:
        ray.get([e.resume_memory.remote(tags) for e in self.engines])

    @staticmethod
    def _stop(engine) -> None:
        """Let the engine stop what it owns (an SGLang server) before its actor is killed."""
        try:
            ray.get(engine.shutdown.remote(), timeout=30)
        except Exception:  # a dead engine has nothing left to stop
            pass

    def shutdown(self) -> None:
        for e in self.engines:
            self._stop(e)
            ray.kill(e)
