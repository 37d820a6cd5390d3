"""A reward model's servers (reward.models.<name>): launched by `SGLangEngine.launch`, the rollout engines' launcher,
with the run's API key, frozen (no weight sync, no memory release), started again when found dead, and requests
spread over them in turn. `RewardModel` scores a sequence classifier through `/classify`; the generative judge
(components/judges.py) is a RewardModel whose servers are chat servers. See reward_models.py for how they combine.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from mgrpo.algorithms.failed_samples import OK, TIMEOUT
from mgrpo.config.reward import RewardModelConfig, engine_share
from mgrpo.rewards import ScoreRequest

log = logging.getLogger("mgrpo")


class RewardModel:
    """One named reward model: its servers, its tokenizer, its scoring."""

    label = "model"
    """How a failure it causes is named (failed_by 'model:<name>', reward/failed/model:<name>)."""
    server_flags: tuple[str, ...] = ("--is-embedding",)

    def __init__(self, name: str, cfg: RewardModelConfig, *, api_key: Optional[str], log_dir: str):
        from transformers import AutoTokenizer

        from mgrpo.rollout.sglang import SGLangEngine

        self.name, self.cfg, self.api_key, self.log_dir = name, cfg, api_key, log_dir
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_path)
        self.restarts = 0
        self._turn = 0
        self._lock = threading.Lock()
        kw = dict(request_timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, api_key=api_key)
        if cfg.url:
            self.engines = [SGLangEngine.connect(cfg.url, **kw)]
        else:
            self.engines = []
            try:
                for _ in range(cfg.engines):
                    self.engines.append(self._launch())
            except BaseException:
                self.close()
                raise

    def _launch(self):
        from mgrpo.rollout.sglang import SGLangEngine

        # one compute thread unless the caller said otherwise: on a CPU node the reward server shares the cores
        # with the ranks and the rollout engines, and thread hand-offs cost more than a small model's forward
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return SGLangEngine.launch(self.cfg.hf_path, tp=self.cfg.tp, enable_memory_saver=False,
                                   mem_fraction_static=engine_share(self.cfg),
                                   extra_args=[*self.server_flags, *self.cfg.server_args], api_key=self.api_key,
                                   log_dir=self.log_dir, request_timeout_s=self.cfg.timeout_s,
                                   max_retries=self.cfg.max_retries, env=env)

    def _revive(self) -> None:
        """Start again each server whose process has exited (a reward engine killed between steps)."""
        for k in range(len(self.engines)):
            self._restart_if_dead(k, self.engines[k])

    def _restart_if_dead(self, k: int, engine) -> bool:
        """Start server k again if `engine` (what the caller used) is it and its process has exited. Scoring threads
        share the engines, so the check and the restart hold a lock: one restart per death."""
        with self._lock:
            if self.engines[k] is not engine:
                return True  # another thread started it again already
            if engine.process is None or engine.process.poll() is None:
                return False
            log.warning("reward %s %s: server %s exited (code %s); starting it again", self.label, self.name,
                        engine.url, engine.process.returncode)
            engine.shutdown()
            self.engines[k] = self._launch()
            self.restarts += 1
            return True

    def on_engine(self, k: int, call):
        """`call(engine)` on server k; when it fails because the server died (killed mid-call), the server is
        started again and the call sent to it once, as a killed reward worker's call is (rewards/judger.py)."""
        from mgrpo.rollout.sglang.http import SGLangRequestError

        engine = self.engines[k]
        try:
            return call(engine)
        except SGLangRequestError:
            if self.cfg.url or not self._restart_if_dead(k, engine):
                raise
        return call(self.engines[k])

    def inputs(self, req: ScoreRequest) -> list[int]:
        """The token ids the reward model reads for one response (see the module docstring)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            prompt = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": str(req.prompt)}]
            text = tok.apply_chat_template(list(prompt) + [{"role": "assistant", "content": req.response}],
                                           tokenize=False, add_generation_prompt=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        ids = tok(str(req.prompt or "") + req.response, add_special_tokens=False)["input_ids"]
        stopped = (req.extra_info or {}).get("finish_reason") == "stop"
        return ids + ([tok.eos_token_id] if stopped and tok.eos_token_id is not None else [])

    def score(self, reqs: Sequence[ScoreRequest]) -> tuple[list[Optional[float]], list[str], list[str]]:
        """(score or None, outcome, error or '') per request; never raises for a server's failure."""
        from mgrpo.rollout.sglang.http import SGLangRequestError

        n = len(reqs)
        scores: list[Optional[float]] = [None] * n
        status, errors = [OK] * n, [""] * n
        if not n:
            return scores, status, errors
        if not self.cfg.url:
            self._revive()
        inputs = [self.inputs(r) for r in reqs]
        size = self.cfg.batch_size
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]

        def run(k: int) -> None:
            idx = chunks[k]
            try:
                got = self.on_engine((self._turn + k) % len(self.engines),
                                     lambda engine: engine.classify([inputs[i] for i in idx]))
            except SGLangRequestError as e:
                for i in idx:
                    status[i], errors[i] = TIMEOUT if e.timeout else "failed", f"model:{self.name}: {e}"
                return
            for i, values in zip(idx, got):
                scores[i] = values[0]  # a Bradley-Terry head: one score (num_labels=1)

        with ThreadPoolExecutor(max_workers=max(1, min(len(self.engines), len(chunks)))) as pool:
            list(pool.map(run, range(len(chunks))))
        self._turn += len(chunks)
        return scores, status, errors

    def close(self) -> None:
        for engine in self.engines:
            try:
                engine.shutdown()
            except Exception as err:  # noqa: BLE001 - a failing shutdown must not hide what caused it
                log.warning("reward model %s: shutdown of %s failed: %s", self.name, engine.url, err)
        self.engines = []
