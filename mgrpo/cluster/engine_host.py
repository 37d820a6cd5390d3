"""The process an engine lives in, and how weight buckets reach it.

An engine is hosted either by an `EngineHost` actor of its own (rollout.mode colocated or
disaggregated) or by a Megatron rank (rollout.mode=hybrid, veRL's hybrid engine: the actor and the
engine share one process, and the weights the rank exports go into the engine without leaving it).
Both hosts answer the same calls, defined once in `EngineSlot`, so the rollout group treats their
handles alike.

Calls run in concurrency groups (Ray threads of the host): `engine` for generation and weights (several
at once, which a server batches; an engine with one model serialises them itself), and `health`, so a
health check is answered while a long generation runs.
"""

from __future__ import annotations

import ray

from mgrpo.heap import trim_after_call
from mgrpo.rollout.factory import build_engine
from mgrpo.rollout.types import GenerateRequest, RolloutEngine, from_columns, to_columns

ENGINE_GROUPS = {"engine": 4, "health": 1}

_hosted: dict = {}
"""This process's engine (by host actor id): what an in-process delivery hands buckets to."""


class EngineSlot:
    """The engine-facing calls of a host process (a Ray actor: `EngineHost` or a Megatron rank)."""

    engine: RolloutEngine = None

    def start_engine(self, name: str, hf_dir: str, kwargs: dict) -> None:
        self.engine = build_engine(name, hf_dir, kwargs)
        _hosted[ray.get_runtime_context().get_actor_id()] = self.engine

    @ray.method(concurrency_group="engine")
    def generate(self, requests: dict, sampling) -> dict:
        """`requests` and the results as columns (`rollout/types.py::to_columns`: cheaper to pickle)."""
        try:
            return to_columns(self.engine.generate(from_columns(GenerateRequest, requests), sampling))
        finally:
            trim_after_call()  # an in-process engine's decode steps freed their logits (mgrpo/heap.py)

    @ray.method(concurrency_group="health")  # answered while generations run: it is what ends them
    def abort_all(self) -> bool:
        """Cut every request in flight (rollout.over_sample_rate's long tail); False: this engine cannot."""
        cut = getattr(self.engine, "abort_all", None)
        if cut is None:
            return False
        cut(cut=True)
        return True

    @ray.method(concurrency_group="engine")
    def update_weights(self, named_tensors):
        self.engine.update_weights(named_tensors)

    @ray.method(concurrency_group="engine")
    def finish_weight_update(self, version: int):
        self.engine.finish_weight_update(version)

    @ray.method(concurrency_group="engine")
    def use_lora_adapter(self, name: str, tensors: dict, config: dict, version: int) -> int:
        return self.engine.use_lora_adapter(name, tensors, config, version)

    @ray.method(concurrency_group="health")
    def health(self):
        return self.engine.health()

    @ray.method(concurrency_group="health")
    def address(self) -> dict:
        """Where the engine is, for weight senders: node, server URL (if any), TP size, the accelerators
        Ray gave its host, the host's actor id, whether the engine has memory to release and whether it
        retries requests itself (the rollout group skips the calls that would return nothing)."""
        e = self.engine
        return {"node_ip": ray.util.get_node_ip_address(), "url": e.url, "tp": e.tp,
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "actor_id": ray.get_runtime_context().get_actor_id(),
                "releases_memory": e.releases_memory, "counts_retries": e.retries is not None,
                "pid": getattr(getattr(e, "process", None), "pid", None)}

    @ray.method(concurrency_group="health")
    def retries(self) -> int:
        """Requests the engine retried itself (HTTP errors, aborted requests) - for metrics."""
        return self.engine.retries or 0

    @ray.method(concurrency_group="health")
    def refused_requests(self):
        """Requests the engine's server refused for a missing or wrong key (None: it does not count them)."""
        return self.engine.refused_requests()

    @ray.method(concurrency_group="engine")
    def release_memory(self, tags=None):
        self.engine.release_memory(tags)

    @ray.method(concurrency_group="engine")
    def resume_memory(self, tags=None):
        self.engine.resume_memory(tags)

    @ray.method(concurrency_group="health")
    def stop_engine(self):
        """Let the engine stop what it owns (a server); the host process stays."""
        self.engine.shutdown()
        _hosted.pop(ray.get_runtime_context().get_actor_id(), None)


@ray.remote(concurrency_groups=ENGINE_GROUPS)
class EngineHost(EngineSlot):
    """A process of its own for one rollout engine (whatever the registry builds for its name)."""

    def __init__(self, name: str, hf_dir: str, kwargs: dict):
        self.start_engine(name, hf_dir, kwargs)


def host_alive(host, timeout_s: float) -> bool:
    """Whether an engine's host answers its health call within `timeout_s` and the engine reports ok (a dead actor,
    a timeout or an engine reporting an error: not alive)."""
    return hosts_alive([host], timeout_s)[0]


def hosts_alive(hosts: list, timeout_s: float) -> list[bool]:
    """`host_alive` of several hosts, asked at once (one `timeout_s` for all)."""
    import time

    refs = [h.health.remote() for h in hosts]
    deadline = time.monotonic() + timeout_s
    out = []
    for ref in refs:
        try:
            out.append(bool(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0)).ok))
        except Exception:  # noqa: BLE001 - dead actor, timeout, or an engine reporting an error
            out.append(False)
    return out


def stop_host(host, timeout_s: float, *, kill: bool = True) -> None:
    """Let the engine stop what it owns (a server), then end its host process (`kill`; a hybrid engine's host is
    a Megatron rank, which stays). A dead or hung engine has nothing left to stop politely."""
    try:
        ray.get(host.stop_engine.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001
        pass
    if kill:
        try:
            ray.kill(host)
        except Exception:  # noqa: BLE001 - already gone
            pass


class HostDelivery:
    """Weight buckets through the engines' hosts: one object transfer per bucket, shared by all engines
    (each host then loads it, or hands it to its server from the server's own node). An engine hosted by
    the sending process itself (rollout.mode=hybrid) gets the bucket in memory, with no transfer."""

    def __init__(self, handles: list, actor_ids: list[str]):
        self.handles = handles
        self.actor_ids = actor_ids

    def _split(self) -> tuple:
        """(the engine hosted by this process, if it is a receiver; the other receivers' hosts)."""
        here = ray.get_runtime_context().get_actor_id()
        return (_hosted[here] if here in self.actor_ids else None,
                [h for h, a in zip(self.handles, self.actor_ids) if a != here])

    def update_weights(self, bucket) -> None:
        local, remote = self._split()
        if local is not None:
            local.update_weights(bucket)
        if remote:
            ref = ray.put(bucket)
            ray.get([h.update_weights.remote(ref) for h in remote])

    def finish_weight_update(self, version: int) -> None:
        """Close the update on every engine (called by the only sender, after its last bucket)."""
        local, remote = self._split()
        if local is not None:
            local.finish_weight_update(version)
        ray.get([h.finish_weight_update.remote(version) for h in remote])
