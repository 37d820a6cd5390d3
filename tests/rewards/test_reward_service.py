"""An HTTP reward service (slime's --rm-url protocol) as a judge: the payload is {prompt, response, label}, the key
comes from the environment as a bearer token, a 5xx is retried with backoff, and a service that answers garbage,
refuses, or hangs past the timeout leaves the sample without a score ('failed' / 'timeout' by 'service:<name>'),
never 0; the composed reward adds the rule's."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mgrpo.rewards import Rubric
from mgrpo.config.reward import RewardConfig, RewardServiceConfig
from mgrpo.rewards import Rules, ScoreRequest
from mgrpo.rewards.service import RewardService


class _Service:
    """A reward service: score = len(response) / 10, or a fault chosen by the response text."""

    def __init__(self):
        self.seen: list[dict] = []
        self.auth: list[str] = []
        self.calls: dict[str, int] = {}
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                svc.seen.append(body)
                svc.auth.append(self.headers.get("Authorization", ""))
                r = body["response"]
                svc.calls[r] = svc.calls.get(r, 0) + 1
                if r == "hang":
                    time.sleep(3)
                status, data = 200, json.dumps({"score": len(r) / 10, "extra": 1}).encode()
                if r == "flaky" and svc.calls[r] == 1:
                    status, data = 503, b"busy"
                elif r == "junk":
                    data = b"<html>oops</html>"
                elif r == "words":
                    data = b'{"score": "good"}'
                elif r == "bad request":
                    status, data = 422, b'{"detail": "no"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.integration
def test_reward_service_protocol_failures_and_composition(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "s3cret")
    svc = _Service()
    try:
        cfg = RewardConfig(num_workers=0, compose={"mgrpo/sum": {"rule": 1.0, "judge": 2.0}},
                           services={"judge": RewardServiceConfig(url=svc.url, api_key_env="MY_JUDGE_KEY", timeout_s=1.0,
                                                                  max_retries=1, backoff_s=0.05)})
        service = RewardService("judge", cfg.services["judge"])
        assert "s3cret" not in repr(service)
        texts = ["5", "flaky", "junk", "words", "bad request", "hang", "12"]
        reqs = [ScoreRequest("mgrpo/sum", t, "5", {"finish_reason": "stop"}, prompt="2+3=") for t in texts]
        got = Rubric(cfg, Rules(cfg), {"judge": service}).score(reqs)
        assert got.status == ["ok", "ok", "failed", "failed", "failed", "timeout", "ok"]
        assert got.scores == pytest.approx([1.0 + 2 * 0.1, 0.0 + 2 * 0.5, None, None, None, None, 0.0 + 2 * 0.2])
        assert got.failed_by[2:6] == ["service:judge"] * 4 and (got.failed, got.timeout) == (3, 1)
        assert svc.calls["flaky"] == 2 and svc.calls["bad request"] == 1 and svc.calls["hang"] == 2
        assert svc.calls["junk"] == 2 and svc.calls["words"] == 1  # not JSON: retried; JSON without a score: final
        assert svc.seen[0] == {"prompt": "2+3=", "response": svc.seen[0]["response"], "label": "5"}
        assert set(svc.auth) == {"Bearer s3cret"}
        monkeypatch.delenv("MY_JUDGE_KEY")
        with pytest.raises(ValueError, match="MY_JUDGE_KEY: the variable is not set"):
            RewardService("judge", cfg.services["judge"])
    finally:
        svc.stop()
