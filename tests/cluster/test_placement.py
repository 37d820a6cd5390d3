"""GPU-shaped placement on CPU: Ray nodes with logical GPUs make every CUDA branch of placement run
(bundles with GPU resources, colocated engines sharing their Megatron ranks' bundles and device ids,
disaggregated engines with GPUs of their own); only the compute stays on the CPU."""

from __future__ import annotations

import os

import pytest
import ray

from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics, small_config


class Recording(Trainer):
    """Records where the engines' hosts landed while Ray is still up."""

    def _start(self, prepared):
        super()._start(prepared)
        self.engine_addresses = ray.get([e.address.remote() for e in self.parts.experiences.rollout.engines])
        self.rank_actor_ids = [r._actor_id.hex() for r in self.parts.actor.group.ranks]


def run_on_logical_gpus(cfg, gpus: int) -> Recording:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, configure_logging=False)
    trainer = Recording(cfg)
    trainer.fit()  # shuts Ray down at the end
    assert not ray.is_initialized()
    return trainer


@pytest.mark.system
def test_colocated_engines_share_their_trainer_ranks_gpus(tmp_path):
    cfg = small_config(str(tmp_path), trainer={"n_gpus_per_node": 2}, rollout={"mode": "colocated"},
                       actor={"tp": 2})
    t = run_on_logical_gpus(cfg, gpus=2)
    p = t.parts.placement
    assert p.gpus and p.hosts_in_actor_bundles and p.rollout is None
    assert p.megatron_gpus == pytest.approx(0.8)
    ranks = t.parts.actor.group.devices
    assert sorted(g for d in ranks for g in d["gpu_ids"]) == ["0", "1"]  # one logical GPU per Megatron rank
    assert t.parts.experiences.rollout.devices == [ranks[0]["gpu_ids"]]  # rollout.tp=1: the engine uses rank 0's GPU
    assert t.engine_addresses[0]["gpu_ids"] == ranks[0]["gpu_ids"]  # and its host sits in rank 0's bundle
    assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]


@pytest.mark.system
def test_disaggregated_engines_get_gpus_of_their_own(tmp_path):
    cfg = small_config(str(tmp_path), trainer={"n_gpus_per_node": 3}, rollout={"mode": "disaggregated", "num_engines": 2})
    t = run_on_logical_gpus(cfg, gpus=3)
    p = t.parts.placement
    assert p.gpus and not p.hosts_in_actor_bundles and p.rollout is not None
    assert p.megatron_gpus == 1.0
    trainer_ids = [g for d in t.parts.actor.group.devices for g in d["gpu_ids"]]
    engine_ids = [g for a in t.engine_addresses for g in a["gpu_ids"]]
    assert len(trainer_ids) == 1 and len(engine_ids) == 2  # 3 GPUs: 1 Megatron rank, 2 engines of rollout.tp=1
    assert sorted(trainer_ids + engine_ids) == ["0", "1", "2"]  # nobody shares
    assert t.parts.experiences.rollout.devices is None
    assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]


@pytest.mark.system
def test_hybrid_engines_live_in_their_trainer_ranks(tmp_path):
    """rollout.mode=hybrid: no engine process and no rollout bundles; engine i is hosted by Megatron rank
    i*rollout.tp (the same actor), whose whole GPU it shares, and its server would use that rank's GPU."""
    cfg = small_config(str(tmp_path), trainer={"n_gpus_per_node": 2}, rollout={"mode": "hybrid"}, actor={"tp": 2})
    t = run_on_logical_gpus(cfg, gpus=2)
    p = t.parts.placement
    assert p.gpus and p.hybrid and not p.hosts_in_actor_bundles and p.rollout is None
    assert p.megatron_gpus == 1.0
    ranks = t.parts.actor.group.devices
    assert t.parts.experiences.rollout.devices == [ranks[0]["gpu_ids"]]
    assert t.engine_addresses[0]["gpu_ids"] == ranks[0]["gpu_ids"]
    assert t.engine_addresses[0]["actor_id"] == t.rank_actor_ids[0]  # the engine's host is Megatron rank 0
    assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]
