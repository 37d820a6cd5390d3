"""Starting (or joining) the Ray cluster and placing bundles.

Local runs get a private, self-contained Ray: token authentication off (Ray 2.60 turns it on and
writes a token under ~/.ray), its own temp dir, no dashboard. A SLURM job joins the cluster that
`slurm/train.sbatch` started (`trainer.ray_address`).
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


def start_ray(*, address: str | None, num_cpus: int | None, num_gpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = os.environ.get("RAY_TMPDIR")
    if not tmp:  # a short private path (Ray's socket paths must stay under ~107 characters)
        tmp = tempfile.mkdtemp(prefix="mgrpo-ray-", dir="/tmp")
        _owned_tmp.append(tmp)
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=True,
             configure_logging=False, _temp_dir=tmp)


def stop_ray() -> None:
    """Shut down the local Ray and remove the temp dir we made for it (a user's RAY_TMPDIR is kept)."""
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
