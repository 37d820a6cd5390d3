"""Starting (or joining) the Ray cluster and placing bundles.

Local runs get a private, self-contained, lean Ray: token authentication off (Ray 2.60 turns it on
and writes a token under ~/.ray), its own temp dir, no usage reporting, and only the processes a run
uses: the GCS, the raylet with its two agents (it exits without them) and our actors; the actors' output
reaches the console through a thread of the driver (ray_logs.py) instead of Ray's log monitor process. No
dashboard, no autoscaler monitor, no idle pre-started workers
(every process of a run is an actor with a process of its own), no metrics or task events that
nobody reads. A SLURM job joins the cluster that `slurm/train.sbatch` started (`trainer.ray_address`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mgrpo.cluster import ray_logs
from mgrpo.heap import arena_env


_owned_tmp: list[str] = []
_forwarders: list = []
"""The local Ray's ray_logs.LogForwarder, stopped by stop_ray."""
_inherited: dict[str, str] = {}
"""What every process of the local Ray started with (inherited_env); empty when joining a cluster."""


def inherited_env() -> dict[str, str]:
    """The environment every process of the Ray this driver started inherits: the Megatron ranks' malloc
    setting (mgrpo/heap.py, set while ray.init starts the raylet, whose workers inherit its environment). A rank
    started with it needs no runtime_env, whose worker starts through the runtime-env agent and setup_worker.py:
    a second Python start-up (cluster/megatron_group.py). Empty when joining a cluster (`trainer.ray_address`)."""
    return dict(_inherited)


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """`env` in os.environ while the block runs (for the processes it starts), then as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


LOCAL_SYSTEM_CONFIG = {
    "enable_worker_prestart": False,          # no idle workers kept warm for tasks we never submit
    "prestart_worker_first_driver": False,
    "enable_metrics_collection": False,       # no Prometheus metrics from every worker
    "task_events_report_interval_ms": 0,      # no task events for the state API / dashboard
    # How long the raylet waits for its agents to report their ports before it exits: as long as ray.init waits
    # for the raylet (node.py: 30 s). On a machine others load (here at load ~30, while the driver imports torch
    # beside ray.init), the agents' Python start took 15 s and the raylet exited: "Timed out waiting for file
    # .../metrics_agent_port_<node>".
    "agent_register_timeout_ms": 30_000,
}
"""Ray system settings of a local run (each checked by the GCS: an unknown key fails `ray.init`)."""


def start_ray(*, address: str | None, num_cpus: int | None, num_gpus: int | None = None) -> None:
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
    forward = ray_logs.available()
    env = arena_env()
    with _without_unused_head_processes(UNUSED_HEAD_PROCESSES + (("start_log_monitor",) if forward else ())), \
            _environment(env):
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, _temp_dir=tmp, _system_config=dict(LOCAL_SYSTEM_CONFIG))
    _inherited.update(env)
    _stop_unused_head_processes()
    if forward:
        _forwarders.append(ray_logs.LogForwarder(ray._private.worker._global_node))


UNUSED_HEAD_PROCESSES = ("start_api_server", "start_monitor")
"""What ray.init starts on a head node that a local run never uses (ray._private.node.Node's methods): the API
server (with include_dashboard=False it only reports usage statistics, which are off) and the autoscaler's
monitor (a single local node never scales)."""


@contextlib.contextmanager
def _without_unused_head_processes(names: tuple[str, ...]):
    """While a local ray.init runs, Node's methods `names` start nothing: UNUSED_HEAD_PROCESSES, and the log
    monitor where ray_logs.LogForwarder takes its place. ray.init has no setting for either
    (include_dashboard=False still starts the API server; RayParams.no_monitor is not reachable from it), and
    starting the API server is the slow part of a local ray.init: the driver polls the GCS until the server
    has imported its modules and published its URL (ray/_private/services.py, start_api_server).
    `benchmarks.measure.startup`, tiny job: see the commit that added this. A Ray without these methods starts
    them as before, and `_stop_unused_head_processes` stops them."""
    node = getattr(getattr(ray, "_private", None), "node", None)
    cls = getattr(node, "Node", None)
    saved = {name: cls.__dict__[name] for name in names if cls is not None and name in cls.__dict__}
    for name in saved:
        setattr(cls, name, _start_nothing)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


def _start_nothing(self, *args, **kwargs) -> None:
    return None


def _stop_unused_head_processes() -> None:
    """Stop UNUSED_HEAD_PROCESSES that ray.init started anyway (a Ray whose Node lacks the methods
    `_without_unused_head_processes` replaces): ~200 MiB of resident memory, and their idle CPU."""
    node = getattr(ray._private.worker, "_global_node", None)
    for kill in ("kill_dashboard", "kill_monitor"):
        if node is not None and hasattr(node, kill):
            getattr(node, kill)(check_alive=False)


def stop_ray() -> None:
    """Shut down the local Ray and remove the temp dir we made for it (a user's RAY_TMPDIR is kept)."""
    while _forwarders:  # first: its last pass publishes while the GCS is up
        _forwarders.pop().stop()
    _inherited.clear()
    if ray.is_initialized():
        ray.shutdown()
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
