"""Network helpers every room may use (standard library only; a leaf: it imports nothing of mgrpo)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ('' = every address; the OS picks it; a race with another binder is
    possible but rare, so callers that can retry on 'address in use' should)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
