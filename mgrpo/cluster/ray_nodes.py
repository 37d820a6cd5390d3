"""Have all of a job's nodes joined the Ray cluster? `wait_for_nodes` polls `ray.nodes()` until every expected
host has an alive Ray node, and otherwise raises an error that names the hosts that are missing (and fails
early when a node's `ray start` step has exited). `python -m mgrpo.cluster.slurm wait ...` runs it."""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Callable, Iterable, Mapping, Optional, Sequence

from mgrpo.net import resolve_all, short_name


class NodesMissingError(TimeoutError):
    """Some SLURM hosts had no alive Ray node when the timeout ran out."""

    def __init__(self, message: str, missing: Sequence[str], joined: Sequence[dict]):
        super().__init__(message)
        self.missing = list(missing)
        self.joined = list(joined)


def missing_hosts(expected: Sequence[str], nodes: Iterable[Mapping], *,
                  resolve: Callable[[str], set[str]] = resolve_all) -> list[str]:
    """The expected hosts without an alive Ray node. A host matches a node by name (short names
    compared, so 'gpu-01' matches 'gpu-01.cluster'), by the node's IP, or by what the host resolves to."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    names = {short_name(str(n.get("NodeManagerHostname", ""))) for n in alive}
    ips = {str(n.get("NodeManagerAddress", "")) for n in alive}
    missing = []
    for host in expected:
        if short_name(host) in names or host in ips:
            continue
        if resolve(host) & ips:
            continue
        missing.append(host)
    return missing


def _summary(nodes: Iterable[Mapping]) -> list[dict]:
    out = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        out.append({"host": n.get("NodeManagerHostname"), "ip": n.get("NodeManagerAddress"),
                    "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0)})
    return sorted(out, key=lambda d: (str(d["host"]), str(d["ip"])))


def _dead_pids(pids: Iterable[int]) -> list[int]:
    dead = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie still answers kill -0
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    dead.append(pid)
        except ProcessLookupError:
            dead.append(pid)
        except (PermissionError, FileNotFoundError, IndexError):
            pass
    return dead


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not HOST:PORT")
    return host, int(port)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def wait_for_nodes(address: Optional[str], expected_hosts: Sequence[str], timeout_s: float, *,
                   poll_s: float = 2.0, watch_pids: Sequence[int] = (),
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    """Block until every host in `expected_hosts` has an alive node in the Ray cluster at `address`
    (HOST:PORT of the head's GCS; None = the cluster this process is already connected to).

    Returns one summary per alive node ({host, ip, cpus, gpus}). Raises NodesMissingError naming
    the missing hosts when `timeout_s` runs out, and as soon as one of `watch_pids` (the `srun` steps
    running `ray start`) has died. Extra nodes in the cluster are fine."""
    expected = list(dict.fromkeys(expected_hosts))
    deadline = time.monotonic() + timeout_s

    def fail(missing: Sequence[str], joined: list[dict], why: str) -> NodesMissingError:
        seen = ", ".join(f"{j['host']} ({j['ip']})" for j in joined) or "none"
        return NodesMissingError(
            f"{len(missing)} of {len(expected)} SLURM node(s) missing from the Ray cluster at {address or 'this'} "
            f"{why}: {' '.join(missing)}. Joined: {seen}. Look for those hosts' 'ray start' output in the job log "
            "(and their Ray logs under the Ray temp dir on that node).", missing, joined)

    def check_pids(missing: Sequence[str], joined: list[dict]) -> None:
        dead = _dead_pids(watch_pids)
        if dead:
            raise fail(missing, joined, f"(ray start step(s) with pid {' '.join(map(str, dead))} exited)")

    import ray

    own = not ray.is_initialized()
    if own:
        if not address:
            raise ValueError("wait_for_nodes: no address given and this process is not connected to Ray")
        host, port = _split_address(address)
        while not _port_open(host, port):
            check_pids(expected, [])
            if time.monotonic() >= deadline:
                raise fail(expected, [], f"(the Ray head at {address} did not accept connections within {timeout_s:g}s)")
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.05)))
        ray.init(address=address, log_to_driver=False, configure_logging=False, logging_level="ERROR")
    try:
        resolved: dict[str, set[str]] = {}

        def resolve(h: str) -> set[str]:
            if h not in resolved:
                resolved[h] = resolve_all(h)
            return resolved[h]

        last_report = 0.0
        while True:
            nodes = ray.nodes()
            missing = missing_hosts(expected, nodes, resolve=resolve)
            joined = _summary(nodes)
            if not missing:
                return joined
            now = time.monotonic()
            if now >= deadline:
                raise fail(missing, joined, f"after {timeout_s:g}s")
            if now - last_report >= 30:
                log(f"waiting for {len(missing)} of {len(expected)} node(s) to join Ray: {' '.join(missing)}")
                last_report = now
            check_pids(missing, joined)
            time.sleep(min(poll_s, max(deadline - now, 0.05)))
    finally:
        if own:
            ray.shutdown()


