"""An HTTP reward service (slime's `--rm-url`, XTuner's API judger): one POST per response,

    POST <url>  {"prompt": <the record's prompt as written>, "response": <decoded response>, "label": <ground truth>}

answered with a number, or a JSON object holding it under `score_key` (slime's `--reward-key`). The key, if any,
is read from the environment variable `api_key_env` and sent as `Authorization: Bearer <key>`: never on the
command line or in a config file. Every call has a timeout and bounded retries with exponential backoff
(connection errors, timeouts, 5xx and 429); a call that fails for good, or answers something that is not a score,
leaves its sample without one ('timeout' or 'failed'), never 0.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from mgrpo.config.reward import RewardServiceConfig
from mgrpo.rewards.scoring import FAILED, OK, TIMEOUT, ScoreRequest, ScoreResult


class RewardService:
    label = "service"

    def __init__(self, name: str, cfg: RewardServiceConfig):
        import requests

        self.name, self.cfg = name, cfg
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and not key:
            raise ValueError(f"reward.services.{name}.api_key_env={cfg.api_key_env}: the variable is not set")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._local = threading.local()
        self._requests = requests
        self.retries = 0

    def __repr__(self) -> str:  # never the key
        return f"RewardService({self.name!r}, {self.cfg.url!r}, key={'yes' if self._headers else 'no'})"

    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self._requests.Session()
            s.headers.update(self._headers)
        return s

    def _one(self, payload: dict) -> tuple[Optional[float], str, str]:
        rq, cfg = self._requests, self.cfg
        error, status = "", FAILED
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(min(cfg.backoff_s * 2 ** (attempt - 1), 8.0))
            try:
                resp = self._session().post(cfg.url, json=payload, timeout=cfg.timeout_s)
            except rq.Timeout as e:
                error, status = f"timed out after {cfg.timeout_s}s ({type(e).__name__})", TIMEOUT
                continue
            except rq.ConnectionError as e:
                error, status = f"{type(e).__name__}: {e}", FAILED
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                error, status = f"HTTP {resp.status_code}: {resp.text[:200]}", FAILED
                continue
            if resp.status_code != 200:
                return None, FAILED, f"HTTP {resp.status_code}: {resp.text[:200]}"  # the request is wrong: no retry
            try:
                value = resp.json()
            except ValueError:
                error, status = f"the answer is not JSON: {resp.text[:200]!r}", FAILED
                continue
            if isinstance(value, dict):
                value = value.get(cfg.score_key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return None, FAILED, f"the answer holds no finite score (under {cfg.score_key!r}): {str(value)[:200]}"
            return float(value), OK, ""
        return None, status, f"{error} ({cfg.max_retries + 1} attempts)"

    def score(self, reqs: Sequence[ScoreRequest]) -> ScoreResult:
        """A score or None per request; never raises for the service's failure."""
        payloads = [{"prompt": r.prompt, "response": r.response, "label": r.ground_truth} for r in reqs]
        result = ScoreResult.empty(len(payloads))
        if not payloads:
            return result
        with ThreadPoolExecutor(max_workers=min(self.cfg.concurrency, len(payloads))) as pool:
            got = list(pool.map(self._one, payloads))
        for i, (score, status, error) in enumerate(got):
            if status == OK:
                result.scores[i] = score
            else:
                result.fail(i, status, f"{self.label}:{self.name}", error)
        return result

    def close(self) -> None:
        s = getattr(self._local, "session", None)
        if s is not None:
            s.close()
