"""Network helpers every room may use (standard library only; a leaf: it imports nothing of mgrpo).

- `free_port`: a TCP port free now, outside the kernel's ephemeral range.
- `node_ip`: THE rule for a node's address on the cluster network (SLURM discovery, the rollout servers,
  the router and the weight senders all ask it), with `is_this_host`, `short_name` and `resolve_all`,
  which match host names to nodes.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Mapping, Optional

NODE_IP_ENV = "MGRPO_NODE_IP"
"""This node's address when set: local runs set 127.0.0.1 (cluster/ray_env.py; Ray's workers inherit it), and
an operator may pin the interface of a multi-homed node."""


class NodeAddressError(RuntimeError):
    """No address could be found for a node."""


LISTEN_PORTS = (20000, 32768)
"""Where `free_port` looks: above Ray's worker ports (10002-19999 by default), below Linux's ephemeral range
(32768-60999 by default; the upper end is lowered to what /proc says)."""

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out to bind(port 0) and to the source side of every connect()."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(family: int, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "", *, attempts: int = 64) -> int:
    """A TCP port free on `host` now ('' = every address).

    Chosen at random below the kernel's ephemeral range, not by bind(port 0): a port from bind(0) lies in the
    range every outgoing connection takes its source port from, so between this choice and the server's own
    bind any connect() on the node (Ray opens hundreds) could take it; a CI run lost an engine that way
    (Errno 98 on 46673). Below the range only an explicit bind takes a port. A race with another explicit
    binder stays possible, so servers started on a chosen port retry on 'address in use'
    (server.start_on_free_port). Falls back to bind(0) when no port in LISTEN_PORTS binds in `attempts` tries."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, hi = LISTEN_PORTS[0], min(LISTEN_PORTS[1], ephemeral_range()[0])
    rng = random.SystemRandom()  # forked processes must not draw the same sequence
    for _ in range(attempts if hi > lo else 0):
        port = rng.randrange(lo, hi)
        if _bindable(family, host, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def short_name(name: str) -> str:
    """'GPU-01.cluster.local' -> 'gpu-01'."""
    return name.split(".")[0].lower()


def is_this_host(name: str) -> bool:
    return short_name(name) in {short_name(socket.gethostname()), short_name(socket.getfqdn())}


def resolve_all(name: str) -> set[str]:
    """Every IPv4 address `name` resolves to (empty when it does not)."""
    try:
        return set(socket.gethostbyname_ex(name)[2])
    except OSError:
        return set()


def route_ip() -> Optional[str]:
    """Source address of the default route (a UDP connect sends no packet), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return None


def node_ip(host: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> str:
    """A node's address on the cluster network (`host`: a node's name; None: this node).

    This node (None, or its own name), first that applies:
      1. $MGRPO_NODE_IP;
      2. what the host name resolves to, unless that is a loopback address (many distributions map the
         own host name to 127.0.1.1 in /etc/hosts);
      3. the source address of the default route;
      4. the loopback address the name resolved to (a machine with no route out).
    Another node: what its name resolves to (2, then 4). NodeAddressError when nothing applies."""
    def this() -> bool:  # asked only when needed: getfqdn may wait on DNS
        return host is None or is_this_host(host)

    if environ.get(NODE_IP_ENV) and this():
        return environ[NODE_IP_ENV]
    name = host or socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        ip = None
    if ip and not ip.startswith("127."):
        return ip
    if this():
        route = route_ip()
        if route:
            return route
    if ip:
        return ip
    raise NodeAddressError(f"cannot resolve the address of node {name!r}; set ${NODE_IP_ENV} on that node "
                           "(or MGRPO_HEAD_IP for the SLURM head)")
