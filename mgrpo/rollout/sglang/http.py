"""HTTP plumbing shared by the SGLang engine client and the trainer-side weight senders.

Bounded retries with exponential backoff for transient failures (connection errors, timeouts,
5xx), each counted; immediate, clear errors for everything else (4xx carry SGLang's message).
Also the capability checks that keep SGLang-only paths from failing obscurely on a CPU machine.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any, Callable, Optional

import requests

from mgrpo.rollout.sglang.auth import bearer

ENGINE_HINT = ("SGLang's own server (rollout.engine=sglang on GPU) needs the `sglang` package with its kernels and "
               "a CUDA device on the rollout workers; without them SGLangEngine.launch runs the CPU server "
               "(mgrpo.rollout.sglang.cpu.server), which speaks the same protocol")


class SGLangUnavailableError(RuntimeError):
    """A GPU/SGLang-only path was asked for where its requirements are missing."""


class SGLangRequestError(RuntimeError):
    """A request to an SGLang server failed for good (non-transient, or out of retries)."""

    def __init__(self, message: str, *, status: Optional[int] = None, transient: bool = False):
        super().__init__(message)
        self.status = status
        self.transient = transient
        """The last failure was of the retryable kind (connection, timeout, 5xx)."""
        self.timeout = False


class SGLangAuthError(SGLangRequestError):
    """The server refused the request's key (401: missing or wrong; 403: an admin key is needed and the
    server has none)."""


class SGLangBadResponseError(SGLangRequestError):
    """The server answered 200 with something that is not SGLang's answer (not JSON, cut short, the
    wrong shape), every time the retry budget allowed."""


def require_sglang(what: str = "launching an SGLang server") -> None:
    """Capability check at call time: the sglang package and a CUDA device."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailableError(f"{what}: the `sglang` package is not installed. {ENGINE_HINT}.")
    require_cuda(what)


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SGLangUnavailableError(f"{what}: no CUDA device is visible (torch.cuda.is_available() is False). "
                                     f"{ENGINE_HINT}.")


def _transient_status(status: int) -> bool:
    return status >= 500


class HTTPClient:
    """JSON over HTTP to one SGLang server, with bounded, counted retries.

    `alive` (optional) is asked before each retry; when it returns a message (the server process
    died, with its log tail) retrying stops at once with that message."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, alive: Optional[Callable[[], Optional[str]]] = None,
                 api_key: Optional[str] = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        """Sent as `Authorization: Bearer <key>` (SGLang's --api-key / --admin-api-key, the router's keys)."""
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.alive = alive
        self.retries = 0
        """Transient failures that were retried, over the client's life."""
        self._lock = threading.Lock()
        self._local = threading.local()  # requests.Session is not documented thread-safe: one per thread

    def __getstate__(self):  # travels to Megatron ranks inside the senders (Ray pickles them)
        state = dict(self.__dict__)
        del state["_lock"], state["_local"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(bearer(self.api_key))
        return s

    def __repr__(self) -> str:  # never the key
        return f"HTTPClient({self.url!r}, key={'yes' if self.api_key else 'no'})"

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def request(self, method: str, path: str, payload: Any = None, *, timeout_s: Optional[float] = None,
                max_retries: Optional[int] = None, ok_statuses: tuple = (200,),
                headers: Optional[dict] = None) -> requests.Response:
        """Send one request; retry transient failures up to `max_retries` times; return the response
        when its status is in `ok_statuses`, raise SGLangRequestError otherwise."""
        url = f"{self.url}{path}"
        budget = self.max_retries if max_retries is None else max_retries
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempt = 0
        while True:
            try:
                resp = self._session().request(method, url, json=payload, timeout=timeout, headers=headers)
                if resp.status_code in ok_statuses:
                    return resp
                if resp.status_code in (401, 403):
                    why = ("no API key was sent" if not self.api_key else "the API key is not the server's")
                    raise SGLangAuthError(f"{method} {url} refused: HTTP {resp.status_code} {_body(resp)} ({why}; "
                                          "the run's key is rollout.api_key)", status=resp.status_code)
                if not _transient_status(resp.status_code):
                    raise SGLangRequestError(f"{method} {url} answered HTTP {resp.status_code}: {_body(resp)}",
                                             status=resp.status_code)
                error = f"HTTP {resp.status_code}: {_body(resp)}"
            except (requests.ConnectionError, requests.Timeout) as e:
                error = f"{type(e).__name__}: {e}"
                timed_out = isinstance(e, requests.Timeout)
            else:
                timed_out = False
            if self.alive is not None:
                dead = self.alive()
                if dead:
                    raise SGLangRequestError(f"{method} {url} failed ({error}) and the server is gone: {dead}")
            if attempt >= budget:
                tries = f" {attempt + 1} times (retry budget {budget}); last error" if budget else ""
                err = SGLangRequestError(f"{method} {url} failed{tries}: {error}", transient=True)
                err.timeout = timed_out
                raise err
            attempt += 1
            self._count_retry()
            time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))

    def post(self, path: str, payload: Any = None, **kw) -> requests.Response:
        return self.request("POST", path, payload if payload is not None else {}, **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return self.request("GET", path, None, **kw)

    def json(self, method: str, path: str, payload: Any = None, **kw) -> Any:
        """A request whose 200 answer must be JSON; an answer that is not (garbage, cut short) is retried
        like a transient failure and, out of retries, raises SGLangBadResponseError."""
        budget = self.max_retries if kw.get("max_retries") is None else kw["max_retries"]
        for attempt in range(budget + 1):
            resp = self.request(method, path, payload, **kw)
            try:
                return resp.json()
            except ValueError as e:
                error = f"{type(e).__name__}: {e}; body: {_body(resp, 200)!r}"
            if attempt < budget:
                self._count_retry()
                time.sleep(min(self.backoff_s * 2 ** attempt, self.max_backoff_s))
        raise SGLangBadResponseError(f"{method} {self.url}{path} answered 200 with a body that is not JSON, "
                                     f"{budget + 1} times (retry budget {budget}); last: {error}")

    def post_result(self, path: str, payload: Any = None, **kw) -> dict:
        """POST to a control endpoint answering {"success": bool, "message": str} (200, or 400 on
        failure); raise with SGLang's message when it did not succeed."""
        resp = self.post(path, payload, ok_statuses=(200, 400), **kw)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code != 200 or not isinstance(body, dict) or not body.get("success", False):
            raise SGLangRequestError(f"POST {self.url}{path} did not succeed (HTTP {resp.status_code}): "
                                     f"{_body(resp)}", status=resp.status_code)
        return body


def _body(resp: requests.Response, limit: int = 2000) -> str:
    text = resp.text or ""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
