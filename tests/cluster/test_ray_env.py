"""A local Ray as `mgrpo.cluster.ray_env.start_ray` starts it: the processes a run uses and no others, and the
actors' output on the driver's console all the same."""

from __future__ import annotations

import os
import time

import pytest


@pytest.mark.integration
def test_local_ray_starts_only_what_a_run_uses(monkeypatch, capfd):
    """Neither the API server (dashboard.py) nor the autoscaler's monitor nor the log monitor is ever started
    (not started and then stopped: starting the API server was the slow part of ray.init), an actor's output
    still reaches this process's console (ray_logs.LogForwarder, a thread here), and Ray's Node class is as it
    was afterwards (a later ray.init elsewhere in the process starts what it always did). Every process of it
    starts with the Megatron ranks' malloc setting (ray_env.inherited_env: a rank needs no runtime_env), which
    this process's own environment does not keep."""
    import psutil
    import ray
    import ray._private.node as node_mod

    from mgrpo.cluster.ray_env import UNUSED_HEAD_PROCESSES, inherited_env, start_ray, stop_ray
    from mgrpo.heap import ARENA_ENV

    replaced = UNUSED_HEAD_PROCESSES + ("start_log_monitor",)
    before = {name: node_mod.Node.__dict__[name] for name in replaced}
    monkeypatch.delenv("RAY_TMPDIR", raising=False)  # start_ray makes a short one of its own, and removes it
    for k in ARENA_ENV:
        monkeypatch.delenv(k, raising=False)
    started: list[str] = []
    printed = ""
    try:
        start_ray(address=None, num_cpus=1)
        node = ray._private.worker._global_node
        assert not {"dashboard", "monitor", "log_monitor"} & set(node.all_processes), sorted(node.all_processes)
        # a process Ray started has its log files (dashboard.err/.out, ...), even one stopped since
        logs = sorted(os.listdir(os.path.join(node.get_session_dir_path(), "logs")))
        assert [f for f in logs if f.split(".")[0] == "gcs_server"], logs
        assert not [f for f in logs if f.split(".")[0] in ("dashboard", "monitor", "log_monitor")], logs

        @ray.remote(num_cpus=1)
        def say(word: str) -> tuple[int, dict]:
            print(word, flush=True)
            return os.getpid(), {k: os.environ.get(k) for k in ARENA_ENV}

        pid, env = ray.get(say.remote("mgrpo-ray-env-marker"), timeout=120)
        assert pid != os.getpid() and env == ARENA_ENV == inherited_env()
        assert not [k for k in ARENA_ENV if k in os.environ]
        for proc in psutil.Process().children(recursive=True):
            try:
                started.append(" ".join(proc.cmdline()))
            except psutil.Error:  # a child that exited meanwhile (a zombie until reaped)
                pass
        deadline = time.time() + 30
        while "mgrpo-ray-env-marker" not in printed and time.time() < deadline:
            time.sleep(0.2)
            out, err = capfd.readouterr()
            printed += out + err
    finally:
        stop_ray()
    assert "mgrpo-ray-env-marker" in printed
    assert started and any("gcs_server" in c for c in started) and any("raylet" in c for c in started), started
    assert not [c for c in started if "dashboard/dashboard.py" in c or "autoscaler/_private/monitor.py" in c
                or "log_monitor.py" in c], started
    assert {name: node_mod.Node.__dict__[name] for name in replaced} == before
    assert inherited_env() == {}
