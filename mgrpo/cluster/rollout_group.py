"""Rollout engines as Ray actors: dispatch, progress, retries, health checks, restarts.

Each engine lives in its own Ray actor (`EngineHost`). The driver splits a batch of requests into
chunks, spreads them over the engines, shows progress as chunks finish, and retries a chunk whose
engine died on a restarted engine that first gets the current weights again. Every retry and
restart is counted and reported in the step's metrics.
"""

from __future__ import annotations

import logging
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
        if kind == "hf":
            from mgrpo.rollout.hf_engine import HFRolloutEngine

            self.engine = HFRolloutEngine(hf_dir, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                          chunk_size=chunk_size, num_threads=num_threads)
        else:
            from mgrpo.rollout.sglang_engine import SGLangEngine

            self.engine = SGLangEngine.launch(hf_dir, **(engine_kwargs or {}))

    def generate(self, requests, sampling):
        return self.engine.generate(requests, sampling)

    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors)

    def finish_weight_update(self, version: int):
        self.engine.finish_weight_update(version)

    def health(self):
        return self.engine.health()

    def release_memory(self):
        self.engine.release_memory()

    def resume_memory(self):
        self.engine.resume_memory()


class EngineReceiver:
    """What a trainer rank holds to push weight buckets to engines hosted in Ray actors: one object
    transfer per bucket, shared by all engines."""

    def __init__(self, handles: list):
        self.handles = handles

    def update_weights(self, bucket) -> None:
        ref = ray.put(bucket)
        ray.get([h.update_weights.remote(ref) for h in self.handles])


@dataclass
class RolloutStats:
    retries: int = 0
    restarts: int = 0
    seconds: float = 0.0
    per_engine: dict = field(default_factory=dict)


class RolloutGroup:
    def __init__(self, cfg: MGRPOConfig, bundles: Bundles, *, hf_dir: str, eos_token_ids: list[int],
                 pad_token_id: int):
        self.cfg = cfg
        self.bundles = bundles
        self.hf_dir = hf_dir
        self._host_args = (cfg.rollout.engine, hf_dir, list(eos_token_ids), pad_token_id, cfg.rollout.generate_chunk,
                           cfg.trainer.cpus_per_worker)
        self.engines = [self._start(i) for i in range(cfg.rollout.num_engines)]
        ray.get([e.health.remote() for e in self.engines])  # wait until every engine is up
        self.weight_version = 0
        self.on_restart: Optional[Callable[[list], None]] = None
        """Set by the loop: pushes the current weights to the given engine handles."""
        self.total = RolloutStats()

    def _start(self, index: int):
        gpus = self.cfg.rollout.tp if self.cfg.trainer.device == "cuda" else 0
        return EngineHost.options(num_cpus=self.cfg.trainer.cpus_per_worker, num_gpus=gpus,
                                  scheduling_strategy=self.bundles.strategy(index),
                                  max_concurrency=2).remote(*self._host_args)

    def receivers(self, engines: Optional[list] = None) -> list:
        """Objects the trainer ranks push weight buckets through (all engines, or the given ones)."""
        return [EngineReceiver(engines if engines is not None else self.engines)]

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

    def release_memory(self) -> None:
        ray.get([e.release_memory.remote() for e in self.engines])

    def resume_memory(self) -> None:
        ray.get([e.resume_memory.remote() for e in self.engines])

    def shutdown(self) -> None:
        for e in self.engines:
            ray.kill(e)
