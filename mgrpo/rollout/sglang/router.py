"""SGLang's router (the `sglang-router` package) in front of several engines: started, health-checked
and kept in step with the engines by us; generation requests go through it.

The router is a Rust binary shipped in a PyPI wheel and runs on CPU, so the same router fronts SGLang's
servers on GPUs and the CPU server in tests. Its control API (sglang-router 0.3.x): `GET /workers` lists
the workers it has registered (registration runs in the background after `POST /workers {"url"}` and
checks the worker's health and model info first), `DELETE /workers/{worker_id}` removes one, `GET /health`
answers once the router is up. Requests sent to the router's `/generate` take SGLang's own payload.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

from mgrpo.rollout.sglang.http import HTTPClient, SGLangRequestError, SGLangUnavailableError
from mgrpo.net import free_port
from mgrpo.rollout.sglang.server import check_host, log_tail, start_server, terminate_group, url_of

log = logging.getLogger(__name__)

ROUTER_MODULE = "sglang_router.launch_router"


def require_router() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SGLangUnavailableError("rollout.num_engines > 1 with rollout.engine=sglang puts SGLang's router in "
                                     "front of the engines: pip install sglang-router")


class Router:
    """One router process in front of `urls`."""

    def __init__(self, urls: Sequence[str], *, host: str, port: Optional[int] = None, policy: str = "round_robin",
                 log_dir: Optional[str] = None, startup_timeout_s: float = 120.0, request_timeout_s: float = 600.0,
                 max_retries: int = 2):
        require_router()
        host = check_host(host)
        port = port or free_port(host)
        self.url = url_of(host, port)
        # Our client retries what fails; the router's own retries would resend a request we also resend.
        cmd = [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port), "--policy", policy,
               "--worker-urls", *urls, "--request-timeout-secs", str(int(request_timeout_s)),
               "--retry-max-retries", str(max_retries), "--log-level", "warn"]
        log_dir = log_dir or tempfile.mkdtemp(prefix="mgrpo-router-")
        self.log_path = os.path.join(log_dir, f"router-{port}.log")
        log.info("starting SGLang router: %s", " ".join(cmd))
        self.process = start_server(cmd, self.url, self.log_path, startup_timeout_s=startup_timeout_s,
                                    ready_path="/health")
        self.client = HTTPClient(self.url, timeout_s=30.0, max_retries=2)
        self.startup_timeout_s = startup_timeout_s
        self.wait_for(set(urls))

    def workers(self) -> dict[str, str]:
        """url -> worker id of the workers the router routes to now."""
        body = self.client.get("/workers").json()
        return {w["url"]: w.get("id") or w.get("worker_id") for w in body.get("workers", [])}

    def wait_for(self, urls: set[str], gone: set[str] = frozenset()) -> None:
        """Until the router lists every url in `urls` and none in `gone` (registration is asynchronous)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            have = set(self.workers())
            if urls <= have and not (gone & have):
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SGLang router at {self.url} lists {sorted(have)}; expected {sorted(urls)}"
                                   f"{f' without {sorted(gone)}' if gone else ''}.\nlast lines of {self.log_path}:\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(0.2)

    def replace(self, old_url: str, new_url: str) -> None:
        """A restarted engine: route to its new server instead of the old one."""
        ids = self.workers()
        if old_url in ids:
            try:
                self.client.request("DELETE", f"/workers/{ids[old_url]}", ok_statuses=(200, 202, 204))
            except SGLangRequestError as e:
                log.warning("router: removing %s failed: %s", old_url, e)
        self.client.post("/workers", {"url": new_url}, ok_statuses=(200, 201, 202))
        self.wait_for({new_url}, gone={old_url} if old_url != new_url else set())

    def shutdown(self) -> None:
        terminate_group(self.process)


class RoutedClient:
    """What the rollout group generates through when a router fronts the engines: the router process and
    an `SGLangEngine` client pointed at it (the same client that talks to a single server)."""

    def __init__(self, urls: Sequence[str], *, host: str, log_dir: Optional[str] = None, **client_kwargs):
        from mgrpo.rollout.sglang.client import SGLangEngine

        self.router = Router(urls, host=host, log_dir=log_dir,
                             request_timeout_s=client_kwargs.get("request_timeout_s", 600.0))
        # One request per POST, many in flight: the router places each one on an engine.
        self.client = SGLangEngine.connect(self.router.url, unbatched=True, concurrency=32, **client_kwargs)

    @property
    def retries(self) -> int:
        return self.client.retries

    def generate(self, requests, sampling):
        return self.client.generate(requests, sampling)

    def replace(self, old_url: str, new_url: str) -> None:
        self.router.replace(old_url, new_url)

    def shutdown(self) -> None:
        self.router.shutdown()
