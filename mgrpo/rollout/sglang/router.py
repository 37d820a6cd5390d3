"""SGLang's router (the `sglang-router` package) in front of several engines: started, health-checked
and kept in step with the engines by us; generation requests go through it.

The router is a Rust binary shipped in a PyPI wheel and runs on CPU, so the same router fronts SGLang's
servers on GPUs and the CPU server in tests. Its control API (sglang-router 0.3.x): `GET /workers` lists
the workers it has registered (registration runs in the background after `POST /workers {"url"}` and
checks the worker's health and model info first), `DELETE /workers/{worker_id}` removes one, `GET /health`
answers once the router is up. Requests sent to the router's `/generate` take SGLang's own payload.

Keys (checked against sglang-router 0.3.2): `--api-key K` is the key the router sends its workers AND the
key it requires from its own clients on the data plane (401 otherwise); `--control-plane-api-keys
'id:name:admin:K'` guards `/workers` (401 without it; the data-plane key is not accepted there); `/health`
stays open. The run's one secret serves as both, and reaches the router through the environment of
`python -m mgrpo.rollout.sglang.router` (this module's `main`), which hands it to sglang-router's own
argument parser inside the process: it is never on a command line. Refusals are read from the router's
Prometheus counter `smg_http_responses_total{status_code="401"}`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from mgrpo.rollout.sglang.http import HTTPClient, SGLangRequestError, SGLangUnavailableError
from mgrpo.net import free_port
from mgrpo.rollout.sglang.server import (check_host, log_tail, start_on_free_port, start_server, terminate_group,
                                         url_of)

log = logging.getLogger(__name__)

KEY_ENV = "MGRPO_ROUTER_API_KEY"
"""How `main` receives the key (removed from its environment once read)."""


def require_router() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SGLangUnavailableError("rollout.num_engines > 1 with rollout.engine=sglang puts SGLang's router in "
                                     "front of the engines: pip install sglang-router")


class Router:
    """One router process in front of `urls`."""

    def __init__(self, urls: Sequence[str], *, host: str, port: Optional[int] = None, policy: str = "round_robin",
                 log_dir: Optional[str] = None, startup_timeout_s: float = 120.0, request_timeout_s: float = 600.0,
                 max_retries: int = 2, api_key: Optional[str] = None):
        """`policy`: round_robin for independent requests; `manual` for sessions (multi-turn trajectories):
        the requests carrying one `x-smg-routing-key` go to one worker, and a new key to the worker holding
        the fewest keys (`--assignment-mode min_group`), so trajectories spread evenly over the engines."""
        require_router()
        host = check_host(host)
        env = {**os.environ, KEY_ENV: api_key} if api_key else {k: v for k, v in os.environ.items() if k != KEY_ENV}
        log_dir = log_dir or tempfile.mkdtemp(prefix="mgrpo-router-")

        def start(port: int) -> subprocess.Popen:
            self.url = url_of(host, port)
            self.metrics_port = free_port(host)  # its Prometheus endpoint (default 29000 would clash across runs)
            # Our client retries what fails; the router's own retries would resend a request we also resend.
            cmd = [sys.executable, "-m", __name__, "--host", host, "--port", str(port), "--policy", policy,
                   "--worker-urls", *urls, "--request-timeout-secs", str(int(request_timeout_s)),
                   "--retry-max-retries", str(max_retries), "--log-level", "warn", "--prometheus-host", host,
                   "--prometheus-port", str(self.metrics_port)]
            if policy == "manual":
                cmd += ["--assignment-mode", "min_group"]
            self.log_path = os.path.join(log_dir, f"router-{port}.log")
            log.info("starting SGLang router (%s): %s", "key required" if api_key else "NO key", " ".join(cmd))
            return start_server(cmd, self.url, self.log_path, startup_timeout_s=startup_timeout_s,
                                ready_path="/health", env=env)

        self.process, _, self.port_retries = start_on_free_port(start, host, port)
        self.client = HTTPClient(self.url, timeout_s=30.0, max_retries=2, api_key=api_key)
        self.api_key = api_key
        self.metrics = HTTPClient(url_of(host, self.metrics_port), timeout_s=10.0, max_retries=0)
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
        # a worker added through the control plane carries its own key (WorkerConfigRequest.api_key); without
        # it the router would ask the new server unauthenticated
        self.client.post("/workers", {"url": new_url, **({"api_key": self.api_key} if self.api_key else {})},
                         ok_statuses=(200, 201, 202))
        self.wait_for({new_url}, gone={old_url} if old_url != new_url else set())

    def refused_requests(self) -> Optional[int]:
        """Requests the router answered 401/403 (missing or wrong key), from its Prometheus counter."""
        try:
            text = self.metrics.get("/metrics").text
        except SGLangRequestError:
            return None
        found = re.findall(r'^smg_http_responses_total\{[^}]*status_code="40[13]"[^}]*\} (\d+)', text, re.M)
        return sum(map(int, found))

    def shutdown(self) -> None:
        terminate_group(self.process)


class RoutedClient:
    """What the rollout group generates through when a router fronts the engines: the router process and
    an `SGLangEngine` client pointed at it (the same client that talks to a single server). A router that
    died is started again in front of the engines' current servers (`restart`)."""

    def __init__(self, urls: Sequence[str], *, host: str, log_dir: Optional[str] = None, policy: str = "round_robin",
                 **client_kwargs):
        self.host, self.log_dir, self.policy, self.client_kwargs = host, log_dir, policy, client_kwargs
        self._retries_before = 0
        """Retries counted by the clients of routers that were replaced, and their starts on another port."""
        self._start(urls)

    def _start(self, urls: Sequence[str]) -> None:
        from mgrpo.rollout.sglang.client import SGLangEngine

        kw = self.client_kwargs
        self.router = Router(urls, host=self.host, log_dir=self.log_dir, api_key=kw.get("api_key"),
                             request_timeout_s=kw.get("request_timeout_s", 600.0), policy=self.policy)
        # One request per POST, many in flight: the router places each one on an engine.
        self.client = SGLangEngine.connect(self.router.url, unbatched=True, concurrency=32, **kw)

    @property
    def retries(self) -> int:
        return self._retries_before + self.router.port_retries + self.client.retries

    def alive(self, timeout_s: float) -> bool:
        """The router process runs and answers `/health` within `timeout_s`."""
        if self.router.process.poll() is not None:
            return False
        try:
            return self.router.client.get("/health", timeout_s=timeout_s, max_retries=0).status_code == 200
        except SGLangRequestError:
            return False

    def restart(self, urls: Sequence[str]) -> None:
        """Replace a dead or hung router with a fresh one in front of `urls` (its own port: requests still
        in flight to the old one fail and are sent again by the rollout group)."""
        log.warning("restarting the SGLang router (was %s, exit code %s)", self.router.url, self.router.process.poll())
        self._retries_before += self.router.port_retries + self.client.retries
        lora_name = self.client.lora_name  # the LoRA adapter the requests name (adapter-only weight sync)
        self.router.shutdown()
        self._start(urls)
        self.client.lora_name = lora_name

    def refused_requests(self) -> Optional[int]:
        return self.router.refused_requests()

    def generate(self, requests, sampling):
        return self.client.generate(requests, sampling)

    def replace(self, old_url: str, new_url: str) -> None:
        self.router.replace(old_url, new_url)

    def shutdown(self) -> None:
        self.router.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """sglang-router's launcher with the key taken from $MGRPO_ROUTER_API_KEY: it becomes the worker key and
    the admin control-plane key inside this process, so no command line shows it."""
    from sglang_router.launch_router import launch_router, parse_router_args

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.startswith(("--api-key", "--control-plane-api-keys")) for a in args):
        sys.exit("mgrpo router: pass the key in $MGRPO_ROUTER_API_KEY, not on the command line")
    key = os.environ.pop(KEY_ENV, None)
    if key:
        args += ["--api-key", key, "--control-plane-api-keys", f"mgrpo:mgrpo:admin:{key}"]
    launch_router(parse_router_args(args))


if __name__ == "__main__":
    main()
