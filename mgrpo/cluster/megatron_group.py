"""The Megatron ranks as Ray actors: one process per rank, placed one per bundle.

The group fans a call out to every rank (megatron ranks must all enter the same collective), hands
each data-parallel replica its shard of the batch, and gathers what the ranks that hold the answer
return (the last pipeline stage for log-probs and metrics, the weight sources for weights).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import ray

from mgrpo.net import free_port
from mgrpo.cluster.engine_host import ENGINE_GROUPS, EngineSlot
from mgrpo.cluster.ray_env import inherited_env
from mgrpo.heap import arena_env, trim_after_call
from mgrpo.observe import gc_pauses
from mgrpo.cluster.placement import Placement
from mgrpo.config import Layout, MGRPOConfig
from mgrpo.rollout.types import WeightDeliveryError


@ray.remote(concurrency_groups=ENGINE_GROUPS)
class MegatronRank(EngineSlot):
    """A process that hosts one `MegatronActor` (imported inside, so the driver never loads megatron)
    and, with rollout.mode=hybrid, a rollout engine too (`EngineSlot`: its calls run in their own
    concurrency groups, so a rank streaming weights can take another stage's bucket for its engine)."""

    def __init__(self, num_threads: int):
        import os

        # before torch loads its OpenMP runtime (a local Ray's rank has no runtime_env setting them: MegatronGroup)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        import torch

        # first thing: on CPU, megatron-core without torch.compile and Triton (mgrpo.training.cpu_compat),
        # before a hybrid engine's transformers import pulls TorchDynamo and, with it, Triton. Only here,
        # in a rank's own process: a driver or test process that imports mgrpo.training keeps both.
        from mgrpo.training.cpu_compat import lean_megatron_import, quiet_megatron_warnings

        lean_megatron_import()
        quiet_megatron_warnings()  # the start-up line names the paths megatron's fallbacks warn about

        torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        self.impl = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rendezvous address for torch.distributed when this rank is rank 0."""
        return ray.util.get_node_ip_address(), free_port()

    def devices(self) -> dict:
        """This rank's node, accelerator ids (what a colocated engine sharing them must use) and process id
        (what a message about its death names)."""
        import os

        return {"node_ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "pid": os.getpid()}

    def setup(self, cfg: MGRPOConfig, **kwargs) -> dict:
        from mgrpo.training.actor import MegatronActor

        self.impl = MegatronActor(cfg, num_threads=self.num_threads, **kwargs)
        info = self.impl.info()
        if self.engine is not None and not cfg.actor.offload.params:  # rollout.mode=hybrid: the engine in this
            # process uses the rank's weights in place (not when they go to host memory while it generates)
            info["engine_shared_bytes"] = self.engine.share(self.impl.shareable_weights())
        if cfg.trainer.gc_freeze:  # the rank's start-up is over (mgrpo/observe/gc_pauses.py)
            info["gc_frozen_objects"] = gc_pauses.freeze()
        trim_after_call()
        return info

    # --- the rank's work (training/actor.py::MegatronActor), one typed call each ---------------------------
    # Each returns what its call freed to the system once that is worth a trim (mgrpo/heap.py): the rank
    # holds its live tensors between calls, not the last call's peak.
    def compute_logprobs(self, batch, which: str, keep: bool = False):
        try:
            return self.impl.compute_logprobs(batch, which, keep=keep)
        finally:
            trim_after_call()

    def train_mini_batch(self, batch) -> dict:
        try:
            return self.impl.train_mini_batch(batch)
        finally:
            trim_after_call()

    def sync_weights(self, receivers: list, bucket_bytes: int, finish_version: Optional[int] = None) -> dict:
        try:
            return self.impl.sync_weights(receivers, bucket_bytes, finish_version)
        finally:
            trim_after_call()

    def peft_tensors(self):
        return self.impl.peft_tensors()

    def offload(self) -> dict:
        try:
            return self.impl.offload()
        finally:
            trim_after_call()

    def restore(self) -> dict:
        return self.impl.restore()

    def offloaded_bytes(self) -> dict:
        return self.impl.offloaded_bytes()

    def save_hf(self, out_dir: str, tokenizer_dir: Optional[str]) -> None:
        self.impl.save_hf(out_dir, tokenizer_dir)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        self.impl.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        self.impl.load_checkpoint(ckpt_dir)

    def shutdown(self) -> None:
        self.impl.shutdown()


class MegatronGroup:
    def __init__(self, cfg: MGRPOConfig, layout: Layout, placement: Placement, *, init_hf_dir: str,
                 total_steps: int, need_ref: bool):
        self.world = layout.megatron_world
        self.dp = layout.dp
        threads = cfg.trainer.cpus_per_worker
        # one malloc arena for the rank's threads (mgrpo/heap.py), from the process's start: a local Ray's
        # processes have it already (ray_env.inherited_env), a cluster's get it through a runtime_env (its worker
        # starts through the runtime-env agent and setup_worker.py, a second Python start-up). The rank sets
        # OMP_NUM_THREADS and TOKENIZERS_PARALLELISM itself, before torch loads.
        env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **arena_env()}
        inherited = inherited_env()
        given = {} if all(inherited.get(k) == v for k, v in arena_env().items()) else {"runtime_env": {"env_vars": env}}
        self.ranks = [
            MegatronRank.options(num_cpus=threads, num_gpus=placement.megatron_gpus,
                                scheduling_strategy=placement.megatron.strategy(i), **given).remote(threads)
            for i in range(self.world)
        ]
        self.devices = ray.get([r.devices.remote() for r in self.ranks])
        self._setup_args = dict(init_hf_dir=init_hf_dir, total_steps=total_steps, need_ref=need_ref)
        self._setup_refs: list = []
        self.info: list[dict] = []

    def setup(self, cfg: MGRPOConfig) -> None:
        """Build the Megatron stages on every rank (after colocated engines took their memory)."""
        self.start_setup(cfg)
        self.finish_setup()

    def start_setup(self, cfg: MGRPOConfig) -> None:
        """Send every rank its stage build and return at once (`finish_setup` waits for it)."""
        master_addr, master_port = ray.get(self.ranks[0].rendezvous_address.remote())
        self._setup_refs = [
            r.setup.remote(cfg, rank=i, world_size=self.world, master_addr=master_addr, master_port=master_port,
                           **self._setup_args)
            for i, r in enumerate(self.ranks)
        ]

    def finish_setup(self) -> None:
        refs, self._setup_refs = self._setup_refs, []
        self.info = self._gather(refs)

    def _all(self, call: Callable) -> list:
        """`call(rank)` (a remote call) on every rank; the results by rank."""
        return self._gather([call(r) for r in self.ranks])

    def _gather(self, refs: list, explain: bool = True, watch: Optional[Callable[[], object]] = None,
                every_s: Optional[float] = None) -> list:
        """Results by rank. A rank that dies fails the call at once, naming the rank, its process and the
        node it was on (the others would otherwise wait in a collective for the whole process-group
        timeout); without `explain` (taking the ranks down) the bare Ray error is raised. `watch` runs
        every `every_s` seconds while the ranks work."""
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=every_s if watch is not None else None)
                if not done:
                    watch()
                    continue
                ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            if not explain:
                raise
            i = refs.index(done[0])
            what = f"Megatron rank {i} (pid {self.devices[i].get('pid')} on {self.devices[i]['node_ip']}) died"
            raise RuntimeError(lost_nodes_message(what, self.devices, err)) from err
        return ray.get(refs)

    def _send_sharded(self, shards: list, call: Callable) -> list:
        """Start `call(rank, shard_of_its_replica)` on every rank; return the calls' refs by rank."""
        if len(shards) != self.dp:
            raise ValueError(f"{len(shards)} shards for {self.dp} data-parallel replicas")
        # A shard that several ranks take (TP, PP and CP ranks of one replica) goes to the object store
        # once; a shard for one rank travels with its call (a put is a round trip of its own).
        takers = [sum(info["dp_rank"] == d for info in self.info) for d in range(self.dp)]
        args_of = [ray.put(s) if n > 1 else s for s, n in zip(shards, takers)]
        return [call(r, args_of[info["dp_rank"]]) for r, info in zip(self.ranks, self.info)]

    def compute_logprobs(self, shards: list, which: str, keep: bool = False) -> Callable[[], list[dict]]:
        """Start the forward on every rank and return at once; calling the result waits for it and gives
        per-shard {'logprobs', 'entropy'}, in data-parallel order (nothing with `keep`: the ranks keep
        the values for the update that follows)."""
        refs = self._send_sharded(shards, lambda r, s: r.compute_logprobs.remote(s, which, keep=keep))

        def wait() -> list[dict]:
            if keep:
                self._gather(refs)
                return []
            by_dp = {info["dp_rank"]: res for info, res in zip(self.info, self._gather(refs)) if res is not None}
            return [by_dp[d] for d in range(self.dp)]

        return wait

    def train_mini_batch(self, shards: list, while_sent: Optional[Callable] = None) -> dict:
        """The step's metrics; for on-policy shards (no old log-probs) also 'per_sample': each shard's
        per-sample log-probs and entropy of the training forward, in data-parallel order. `while_sent`
        runs once the update is on its way (waiting for a forward the ranks run before it)."""
        refs = self._send_sharded(shards, lambda r, s: r.train_mini_batch.remote(s))
        if while_sent is not None:
            while_sent()
        results = self._gather(refs)
        out = {k: v for k, v in results[0].items() if k != "per_sample"}
        by_dp = {info["dp_rank"]: res["per_sample"] for info, res in zip(self.info, results) if "per_sample" in res}
        if by_dp:
            out["per_sample"] = [by_dp[d] for d in range(self.dp)]
        return out

    def sync_weights(self, receivers: list, bucket_bytes: int, finish_version: int | None = None,
                     watch: Optional[Callable[[], object]] = None, every_s: Optional[float] = None) -> dict:
        """Stream the weights through `receivers`; `watch` runs every `every_s` seconds meanwhile (the rollout
        group's health check: an engine that hangs while it takes the weights is restarted, which ends the
        hung delivery). A delivery that failed raises WeightDeliveryError once every rank is done."""
        refs = [r.sync_weights.remote(receivers, bucket_bytes, finish_version) for r in self.ranks]
        try:
            results = self._gather(refs, watch=watch, every_s=every_s)
        except ray.exceptions.RayTaskError as err:
            ray.wait(refs, num_returns=len(refs), timeout=120.0)  # the others finish their stream (collectives)
            raise WeightDeliveryError(f"weight sync failed: {err}") from err
        return {"bytes": sum(r["bytes"] for r in results), "tensors": sum(r["tensors"] for r in results),
                "seconds": max(r["seconds"] for r in results), "finished": any(r["finished"] for r in results)}

    def offload(self, back: bool = False) -> dict:
        """actor.offload on every rank: to host memory (`back`: from it); the bytes moved on all ranks and the
        slowest rank's seconds."""
        got = self._all(lambda r: (r.restore if back else r.offload).remote())
        return {"perf/offload_s": max(g["perf/offload_s"] for g in got),
                "perf/offload_bytes": sum(g["perf/offload_bytes"] for g in got)}

    def offloaded_bytes(self) -> list[dict]:
        return self._all(lambda r: r.offloaded_bytes.remote())

    def save_hf(self, out_dir: str, tokenizer_dir: str | None) -> None:
        self._all(lambda r: r.save_hf.remote(out_dir, tokenizer_dir))

    def peft_tensors(self) -> dict:
        """The adapters in PEFT layout (global rank 0 collects them; every rank takes part in the gathers)."""
        return self._all(lambda r: r.peft_tensors.remote())[0]

    def save_checkpoint(self, ckpt_dir: str) -> None:
        self._all(lambda r: r.save_checkpoint.remote(ckpt_dir))

    def load_checkpoint(self, ckpt_dir: str) -> None:
        self._all(lambda r: r.load_checkpoint.remote(ckpt_dir))

    def shutdown(self) -> None:
        try:
            if self.info:  # the Megatron stages were built (`setup` ran): take their process groups down
                self._gather([r.shutdown.remote() for r in self.ranks], explain=False)
        except ray.exceptions.RayActorError:
            pass  # a rank that died was named when the run failed; the others are killed below
        finally:
            for r in self.ranks:
                ray.kill(r)


def dead_nodes(wait_s: float = 0.0) -> set[str]:
    """Addresses of the Ray nodes that left the cluster; waits up to `wait_s` for one to be reported (an
    actor's death is often seen before the cluster has declared its node dead)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = {n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive", True)}
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(1.0)


def lost_nodes_message(what: str, rank_devices: list[dict], err: Exception) -> str:
    """Name the Ray nodes that are gone (and which Megatron ranks were on them), so that the user knows
    which machine to look at before resuming with trainer.resume=auto."""
    dead = dead_nodes(wait_s=60.0)
    ranks = [i for i, d in enumerate(rank_devices) if d["node_ip"] in dead]
    where = (f"node(s) {sorted(dead)} left the Ray cluster (Megatron ranks {ranks} were there)" if dead
             else "no Ray node is reported dead")
    return f"{what}: {where}; run again with trainer.resume=auto to continue from the last checkpoint. ({err})"
