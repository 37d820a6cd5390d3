"""What stands in front of the CPU server's routes: SGLang's API-key check and a body-size bound.

Both are plain ASGI middlewares, as SGLang's own key check is (srt/utils/auth.py::add_api_key_middleware):
they answer before a route runs and before the body is read, so an unauthenticated request never reaches
a JSON parser, let alone `update_weights_from_tensor`'s unpickler. Refusals are counted (by path and
status), logged, and exported at `/metrics` (open without a key, as SGLang's is).

The body bound is ours (SGLang sets none): a request whose body exceeds `max_body_bytes` gets 413 without
being buffered, so a client cannot make the server hold an unbounded body in memory.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Optional

from mgrpo.rollout.sglang.cpu.auth import decide

log = logging.getLogger("mgrpo.cpu_server")

MAX_BODY_BYTES = 64 * 2 ** 20
"""The largest body the CPU server reads: far above any rollout batch or weight-update request (tensors
travel by handle or broadcast, never in the body)."""


class Refusals:
    """Requests refused before reaching a route, by (path, status); thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    def add(self, path: str, status: int) -> None:
        with self._lock:
            self.counts[(path, status)] += 1

    def total(self, statuses=(401, 403)) -> int:
        with self._lock:
            return sum(n for (_, s), n in self.counts.items() if s in statuses)

    def prometheus(self) -> str:
        """The counters in Prometheus' text format (what SGLang's /metrics speaks)."""
        lines = ["# HELP mgrpo_cpu_server_refused_total Requests refused before reaching a route.",
                 "# TYPE mgrpo_cpu_server_refused_total counter"]
        with self._lock:
            for (path, status), n in sorted(self.counts.items()):
                lines.append(f'mgrpo_cpu_server_refused_total{{path="{path}",status="{status}"}} {n}')
        return "\n".join(lines) + "\n"


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """ASGI middleware: the key check (SGLang's rules and answers: 401 {"error": "Unauthorized"}, 403
    {"error": "Forbidden"}), then the body bound (413)."""

    def __init__(self, app, *, api_key: Optional[str], admin_api_key: Optional[str], refusals: Refusals,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.refusals = refusals
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allowed, status = decide(method, path, headers.get("authorization"), self.api_key, self.admin_api_key)
        if not allowed:
            if method == "PRI":  # an HTTP/2 connection preface (sglang-router tries h2 first): not a request
                await _send_json(send, status, {"error": "Unauthorized" if status == 401 else "Forbidden"})
                return
            self.refusals.add(path, status)
            client = scope.get("client") or ("?", 0)
            log.warning("refused %s %s from %s:%s: HTTP %d (%s API key)", method, path, client[0], client[1], status,
                        "no" if "authorization" not in headers else "wrong")
            await _send_json(send, status, {"error": "Unauthorized" if status == 401 else "Forbidden"})
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            self.refusals.add(path, 413)
            await _send_json(send, 413, {"error": {"message": f"request body of {declared} bytes exceeds the CPU "
                                                              f"server's limit of {self.max_body_bytes} bytes"}})
            return
        await self.app(scope, self._bounded(receive, path), send)

    def _bounded(self, receive, path: str):
        """A chunked body (no Content-Length) is counted as it arrives and cut off past the bound."""
        seen = 0

        async def wrapped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    self.refusals.add(path, 413)
                    raise BodyTooLarge(f"request body exceeds the CPU server's limit of {self.max_body_bytes} bytes")
            return message

        return wrapped


class BodyTooLarge(ValueError):
    """A chunked body grew past the bound while being read (answered 413 by the server's handler)."""
