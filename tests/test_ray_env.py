"""A local Ray as `mgrpo.cluster.ray_env.start_ray` starts it: the processes a run uses and no others."""

from __future__ import annotations

import os

import pytest


@pytest.mark.integration
def test_local_ray_starts_without_api_server_or_monitor(monkeypatch):
    """Neither the API server (dashboard.py) nor the autoscaler's monitor is ever started (not started and then
    stopped: starting the API server was the slow part of ray.init), an actor still runs, and Ray's Node class
    is as it was afterwards (a later ray.init elsewhere in the process starts what it always did)."""
    import psutil
    import ray
    import ray._private.node as node_mod

    from mgrpo.cluster.ray_env import UNUSED_HEAD_PROCESSES, start_ray, stop_ray

    before = {name: node_mod.Node.__dict__[name] for name in UNUSED_HEAD_PROCESSES}
    monkeypatch.delenv("RAY_TMPDIR", raising=False)  # start_ray makes a short one of its own, and removes it
    started: list[str] = []
    try:
        start_ray(address=None, num_cpus=1)
        node = ray._private.worker._global_node
        assert not {"dashboard", "monitor"} & set(node.all_processes), sorted(node.all_processes)
        # a process Ray started has its log files (dashboard.err/.out, monitor.err/.out), even one stopped since
        logs = sorted(os.listdir(os.path.join(node.get_session_dir_path(), "logs")))
        assert [f for f in logs if f.split(".")[0] == "gcs_server"], logs
        assert not [f for f in logs if f.split(".")[0] in ("dashboard", "monitor")], logs
        started = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]

        @ray.remote(num_cpus=1)
        def pid() -> int:
            return os.getpid()

        assert ray.get(pid.remote(), timeout=120) != os.getpid()
    finally:
        stop_ray()
    assert started and any("gcs_server" in c for c in started) and any("raylet" in c for c in started), started
    assert not [c for c in started if "dashboard/dashboard.py" in c or "autoscaler/_private/monitor.py" in c], started
    assert {name: node_mod.Node.__dict__[name] for name in UNUSED_HEAD_PROCESSES} == before
