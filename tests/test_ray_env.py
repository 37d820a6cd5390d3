"""The local Ray's processes start with the Megatron ranks' environment, so a rank needs no runtime_env
(mgrpo/cluster/ray_env.py: a runtime_env costs every actor start a runtime-env agent round trip and a second
Python start-up); on a Ray this process did not start that way the variables still reach the actor."""

from __future__ import annotations

import os

import pytest

from mgrpo.cluster import ray_env
from mgrpo.cluster.placement import rank_env


def test_actor_env_is_a_runtime_env_unless_the_local_ray_started_with_it(monkeypatch):
    env = rank_env(2)
    assert env == {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false",
                   "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}
    monkeypatch.setattr(ray_env, "_inherited", {})  # joined cluster, or a Ray the caller started
    assert ray_env.actor_env(env) == {"runtime_env": {"env_vars": env}}
    monkeypatch.setattr(ray_env, "_inherited", dict(env))
    assert ray_env.actor_env(env) == {}
    monkeypatch.setattr(ray_env, "_inherited", {**env, "OMP_NUM_THREADS": "4"})  # another thread count
    assert ray_env.actor_env(env) == {"runtime_env": {"env_vars": env}}


@pytest.mark.integration
def test_local_ray_hands_the_worker_env_to_actors_without_a_runtime_env(monkeypatch):
    import ray

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("MGRPO_TEST_WORKER_ENV", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")  # the driver's own value, kept for the driver
    wanted = {"MALLOC_ARENA_MAX": "1", "MGRPO_TEST_WORKER_ENV": "from-the-raylet"}

    @ray.remote
    class Probe:
        def start_env(self) -> dict:
            # the environment the process was exec'd with (what glibc's malloc read), not os.environ now
            with open("/proc/self/environ", "rb") as f:
                pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
            return {k.decode(): v.decode() for k, v in pairs if k.decode() in wanted}

    try:
        ray_env.start_ray(address=None, num_cpus=1, worker_env=wanted)
        assert os.environ["MALLOC_ARENA_MAX"] == "8" and "MGRPO_TEST_WORKER_ENV" not in os.environ
        options = ray_env.actor_env(wanted)
        assert options == {}
        probe = Probe.options(num_cpus=1, **options).remote()
        assert ray.get(probe.start_env.remote(), timeout=120) == wanted
    finally:
        ray_env.stop_ray()
    assert ray_env.actor_env(wanted) == {"runtime_env": {"env_vars": wanted}}  # that Ray is gone
