"""The actors' output on the driver's console, forwarded by a thread of the driver instead of Ray's log monitor.

A local Ray (`ray_env.start_ray`) would start `log_monitor.py`, a Python process of its own (~47 MiB PSS: the
third largest of the tiny job's tree after the Megatron rank and the driver) whose one job is to tail the
workers' log files and publish new lines to the GCS, where the driver's log subscriber prints them
(`log_to_driver=True`). `LogForwarder` runs Ray's own `LogMonitor` (the same class, the same files, the same
publishing) in a daemon thread of the driver: the console shows what it showed, and the tree has one process
less. Its loop is Ray's `LogMonitor.run` with a stop: idle, it checks the files every 0.1 s, as Ray's does.
A Ray whose log monitor lacks what this uses keeps its own process (`available`).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("mgrpo")

LOOP_METHODS = ("should_update_filenames", "update_log_filenames", "open_closed_files",
                "check_log_files_and_publish_updates")
"""What the forwarder calls of Ray's LogMonitor: the body of its run()."""


def available() -> bool:
    try:
        from ray import _raylet
        from ray._private import log_monitor
    except ImportError:
        return False
    return (hasattr(_raylet, "GcsClient") and hasattr(log_monitor, "is_proc_alive")
            and all(hasattr(getattr(log_monitor, "LogMonitor", None), name) for name in LOOP_METHODS))


class LogForwarder:
    """Ray's LogMonitor over `node`'s log folder, in a daemon thread, until `stop`."""

    def __init__(self, node):
        from ray._private.log_monitor import LogMonitor, is_proc_alive
        from ray._raylet import GcsClient

        # gcs_address=None: LogMonitor then skips its autoscaler-v2 probe (a local run starts no autoscaler)
        self._monitor = LogMonitor(node.node_ip_address, node.get_logs_dir_path(),
                                   GcsClient(address=node.gcs_address), is_proc_alive)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mgrpo-ray-logs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        m = self._monitor
        updated = time.time()
        try:
            while True:
                stopping = self._stop.is_set()
                if m.should_update_filenames(updated):
                    m.update_log_filenames()
                    updated = time.time()
                m.open_closed_files()
                published = m.check_log_files_and_publish_updates()
                if stopping:  # one last pass after the stop: lines written just before it are published too
                    return
                if not published:
                    self._stop.wait(0.1)
        except Exception as err:  # the run goes on; only the actors' console output stops
            log.warning("forwarding the Ray actors' output to this console stopped: %r (their log files are in "
                        "%s)", err, m.logs_dir)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
