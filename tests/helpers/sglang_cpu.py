"""Helpers for the tests that run the real CPU rollout server (a subprocess launched by
`SGLangEngine.launch`, exactly as the rollout group starts it) against an independent reference:
a transformers model holding the same weights, scored by one full forward."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Sequence

import requests
import torch

from mgrpo.config.schema import ModelConfig
from mgrpo.models.hf_io import init_hf_checkpoint
from mgrpo.rollout.sglang import SGLangEngine


VOCAB = ModelConfig().vocab_size  # the tiny model: 16 tokens


def tiny_checkpoint(out_dir: str, seed: int = 1) -> str:
    return init_hf_checkpoint(out_dir, ModelConfig(), seed=seed)


def launch(hf_dir: str, log_dir: str, **kw) -> SGLangEngine:
    kw.setdefault("retry_backoff_s", 0.05)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: the server must not take both
    return SGLangEngine.launch(hf_dir, host="127.0.0.1", startup_timeout_s=180, log_dir=log_dir, env=env, **kw)


class Reference:
    """The same weights in a plain transformers model; log-probs from one forward over prompt+response."""

    def __init__(self, hf_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.params = dict(self.model.named_parameters())

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        for n, t in named:
            self.params[n].copy_(t)

    @torch.no_grad()
    def logprobs(self, prompt: Sequence[int], tokens: Sequence[int], temperature: float) -> torch.Tensor:
        """Full tempered log-distribution at each response position: [len(tokens), vocab]."""
        ids = torch.tensor([list(prompt) + list(tokens)])
        logits = self.model(ids).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)

    def max_diff(self, prompt, result, temperature: float) -> float:
        if not result.token_ids:
            return 0.0
        lp = self.logprobs(prompt, result.token_ids, temperature)
        mine = lp.gather(-1, torch.tensor(result.token_ids)[:, None]).squeeze(-1)
        return float((mine - torch.tensor(result.logprobs)).abs().max())


def perturbed(state: dict[str, torch.Tensor], version: int, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    """New weights for sync `version`: different per version, deterministic."""
    g = torch.Generator().manual_seed(1000 + version)
    return [(n, t + scale * torch.randn(t.shape, generator=g)) for n, t in state.items()]


def torch_shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("torch_")} if os.path.isdir("/dev/shm") else set()


class FaultProxy:
    """Forwards to a real server, answering the first requests of a path with injected statuses
    (a 5xx from a load balancer, say) or with garbage bodies under 200 - the faults the real server
    cannot be asked to make.
    Bounded: stops by itself after `lifetime_s`."""

    def __init__(self, upstream: str, lifetime_s: float = 60.0):
        self.upstream = upstream.rstrip("/")
        self.inject: dict[str, list[int]] = {}
        self.delay: dict[str, list[float]] = {}  # seconds to hold a request before forwarding it
        self.garbage: dict[str, list[bytes]] = {}  # bodies answered with 200 instead of the server's answer
        self.seen: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self, method: str):
                proxy.seen.append(self.path)
                delays = proxy.delay.get(self.path)
                if delays:
                    time.sleep(delays.pop(0))
                queue = proxy.inject.get(self.path)
                junk = proxy.garbage.get(self.path)
                if queue:
                    status = queue.pop(0)
                    data = b'{"error": "injected by FaultProxy"}'
                elif junk:
                    n = int(self.headers.get("Content-Length", 0))
                    self.rfile.read(n)
                    status, data = 200, junk.pop(0)
                else:
                    n = int(self.headers.get("Content-Length", 0))
                    body = self.rfile.read(n) if n else None
                    try:
                        r = requests.request(method, proxy.upstream + self.path, data=body,
                                             headers={"Content-Type": "application/json"}, timeout=120)
                        status, data = r.status_code, r.content
                    except requests.RequestException:  # the upstream went away (a held request outlived it)
                        status, data = 502, b'{"error": "upstream unreachable"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def stop(self):
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def post(url: str, path: str, body: Optional[dict] = None, timeout: float = 60) -> requests.Response:
    return requests.post(url + path, json=body if body is not None else {}, timeout=timeout)
