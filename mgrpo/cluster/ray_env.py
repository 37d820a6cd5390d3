"""Starting (or joining) the Ray cluster and placing bundles.

Local runs get a private, self-contained, lean Ray: token authentication off (Ray 2.60 turns it on
and writes a token under ~/.ray), its own temp dir, no usage reporting, and only the processes a run
uses: the GCS, the raylet with its two agents (it exits without them), the log monitor (actor output
on the console) and our actors. No dashboard, no autoscaler monitor, no idle pre-started workers
(every process of a run is an actor with a process of its own), no metrics or task events that
nobody reads. A SLURM job joins the cluster that `slurm/train.sbatch` started (`trainer.ray_address`).

A local Ray's processes start with the environment a Megatron rank needs (`worker_env`): the raylet
passes its own environment to every worker it starts, so a rank needs no `runtime_env` (`actor_env`).
A `runtime_env` costs every actor start a round trip to the runtime-env agent and a second Python
start-up (Ray's setup_worker.py, which then execs the worker): ~1 s of a quiet machine, 2 s at load 11,
on the path to the first step. A joined cluster's raylet has its own environment: ranks there take
the variables as a `runtime_env`, as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


_owned_tmp: list[str] = []
_inherited: dict[str, str] = {}
"""The environment variables every process of the local Ray this process started was started with."""

LOCAL_SYSTEM_CONFIG = {
    "enable_worker_prestart": False,          # no idle workers kept warm for tasks we never submit
    "prestart_worker_first_driver": False,
    "enable_metrics_collection": False,       # no Prometheus metrics from every worker
    "task_events_report_interval_ms": 0,      # no task events for the state API / dashboard
}
"""Ray system settings of a local run (each checked by the GCS: an unknown key fails `ray.init`)."""


def start_ray(*, address: str | None, num_cpus: int | None, num_gpus: int | None = None,
              worker_env: dict[str, str] | None = None) -> None:
    """Join `address`, or start a private local Ray whose processes (and so every worker the raylet starts)
    have `worker_env` in their environment; this process's own environment is left as it was."""
    if ray.is_initialized():
        return
    # Processes Ray starts inherit this: no per-engine "Loading weights" bar interleaved with the run's lines.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if address:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # One machine: the rollout servers, the router and the weight-update groups listen on loopback only
    # (mgrpo/net.py::node_ip reads this; Ray's workers inherit it).
    os.environ.setdefault("MGRPO_NODE_IP", "127.0.0.1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would report usage over the network
    tmp = os.environ.get("RAY_TMPDIR")
    if not tmp:  # a short private path (Ray's socket paths must stay under ~107 characters)
        tmp = tempfile.mkdtemp(prefix="mgrpo-ray-", dir="/tmp")
        _owned_tmp.append(tmp)
    env = dict(worker_env or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # what the processes ray.init starts inherit: the raylet hands it to its workers
    try:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _temp_dir=tmp, _system_config=dict(LOCAL_SYSTEM_CONFIG))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _inherited.clear()
    _inherited.update(env)
    _stop_unused_head_processes()


def actor_env(env: dict[str, str]) -> dict:
    """Ray actor options that give the actor's process `env`: none when the local Ray this process started
    gave it to every worker already (`start_ray`'s worker_env), else a runtime_env."""
    if all(_inherited.get(k) == v for k, v in env.items()):
        return {}
    return {"runtime_env": {"env_vars": dict(env)}}


def _stop_unused_head_processes() -> None:
    """ray.init always starts an API server (with include_dashboard=False it only reports usage
    statistics, which are off) and the autoscaler's monitor (a single local node never scales); a
    local run uses neither, so both are stopped (~200 MiB of resident memory, and their idle CPU)."""
    node = getattr(ray._private.worker, "_global_node", None)
    for kill in ("kill_dashboard", "kill_monitor"):
        if node is not None and hasattr(node, kill):
            getattr(node, kill)(check_alive=False)


def stop_ray() -> None:
    """Shut down the local Ray and remove the temp dir we made for it (a user's RAY_TMPDIR is kept)."""
    if ray.is_initialized():
        ray.shutdown()
    _inherited.clear()
    while _owned_tmp:
        shutil.rmtree(_owned_tmp.pop(), ignore_errors=True)


@dataclass
class Bundles:
    """A placement group and how many of its bundles each process takes."""

    pg: PlacementGroup
    count: int

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)

    def remove(self) -> None:
        remove_placement_group(self.pg)


def reserve(count: int, *, cpus: float, gpus: float = 0.0, name: str, timeout_s: float = 300.0) -> Bundles:
    """Reserve `count` bundles, packed onto as few nodes as possible; fail with a clear message if the
    cluster cannot hold them (rather than waiting forever)."""
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"Ray could not place {count} bundles of {bundle} for {name} within {timeout_s:.0f}s; "
                           f"cluster resources: {ray.cluster_resources()}") from None
    return Bundles(pg, count)
