"""Reward models on auxiliary engines, and the judger that combines them with the rules per data_source.

A reward model (reward.models.<name>) is a sequence classifier served as SGLang serves one: `--is-embedding`,
scored through `/classify` (on CPU the CPU server does the same over transformers, rollout/sglang/cpu/classify.py).
Its servers are launched by `SGLangEngine.launch`, the rollout engines' launcher, with the run's API key; they are
frozen (no weight sync, no memory release). Before each scoring call a server whose process has died is started
again (counted: reward/model_restarts), and a call that failed because its server died mid-call is sent once more to
the server started in its place; a request that fails anyway (timeout, 5xx, an answer that is not SGLang's,
each retried within reward.models.<name>.max_retries with backoff) leaves its samples without a score, never 0:
the experience masks and counts them (algorithms/failed_samples.py).

Each conversation is formatted with the reward model's own tokenizer: its chat template over the record's prompt
messages plus the response as the assistant's turn; a tokenizer without a chat template (the synthetic one) reads
prompt text + response, and EOS when the response ended with it (a stopped answer is the complete answer).

`ComposedJudger` has the Judger's `score`: per data_source the weighted sum of its scorers (reward.compose), the
rule (rules/ judges in worker processes), the models and the HTTP reward services (rewards/service.py); every scorer's own mean is reported
(reward/<scorer>/mean), the rule's too where it has weight 0, so reward hacking shows when the two part.
It runs inside `Experience.judge`, i.e. while the trainer computes the step's log-probs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from mgrpo.algorithms.failed_samples import OK, TIMEOUT
from mgrpo.config.reward import RewardConfig, RewardModelConfig, engine_share
from mgrpo.rewards import Judger, ScoreRequest, ScoreResult
from mgrpo.rewards.registry import EVERY_SOURCE, reward_functions
from mgrpo.rewards.service import RewardService

log = logging.getLogger("mgrpo")

RULE = "rule"


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


class ComposedJudger:
    """The Judger's interface over rules and reward models, combined per data_source by reward.compose."""

    def __init__(self, cfg: RewardConfig, rule: Judger, models: dict):
        """`models`: name -> a RewardModel or a RewardService (anything with `score` and `close`)."""
        self.cfg, self.rule, self.models = cfg, rule, models
        fns = reward_functions(cfg)
        self._has_rule = lambda src: src in fns or EVERY_SOURCE in fns  # noqa: E731

    def weights(self, data_source: str) -> dict[str, float]:
        return dict(self.cfg.compose.get(data_source) or self.cfg.compose.get(EVERY_SOURCE) or {RULE: 1.0})

    def score(self, requests: list[ScoreRequest]) -> ScoreResult:
        n = len(requests)
        weights = [self.weights(r.data_source) for r in requests]
        result = ScoreResult(scores=[None] * n, status=[OK] * n, failed_by=[""] * n)
        parts: dict[str, tuple[list[int], list, list, list]] = {}
        # the rule: where it has weight, and at weight 0 where one exists (what the task says, next to the model)
        idx = [i for i, (r, w) in enumerate(zip(requests, weights)) if RULE in w or self._has_rule(r.data_source)]
        if idx:
            got = self.rule.score([requests[i] for i in idx])
            parts[RULE] = (idx, got.scores, got.status, got.errors)
            result.worker_restarts += got.worker_restarts
        for name, model in self.models.items():
            idx = [i for i, w in enumerate(weights) if name in w]
            if idx:
                t0 = time.perf_counter()
                scores, status, errors = model.score([requests[i] for i in idx])
                dt = time.perf_counter() - t0
                parts[name] = (idx, scores, status, [e for e in errors if e])
                result.measured[f"reward/{name}/seconds"] = dt
                result.measured[f"reward/{name}/samples_per_s"] = len(idx) / max(dt, 1e-9)
        result.measured["reward/model_restarts"] = float(sum(getattr(m, "restarts", 0) for m in self.models.values()))
        for name, model in self.models.items():  # a judge's own counts (unparsed answers, pairwise disagreements)
            result.measured.update({f"reward/{name}/{k}": float(v) for k, v in getattr(model, "counts", {}).items()})
        own: list[dict[str, tuple[Optional[float], str]]] = [{} for _ in range(n)]
        for name, (idx, scores, status, errors) in parts.items():
            result.components[name] = [None] * n
            for i, s, st in zip(idx, scores, status):
                own[i][name] = (s, st)
                result.components[name][i] = s if st == OK else None
            result.errors.extend(errors[:3])
        for i, w in enumerate(weights):
            failed = next(((name, st) for name in w if (st := own[i][name][1]) != OK), None)
            if failed is not None:  # a scorer with weight failed: no reward (a weight-0 rule cannot fail it)
                name, st = failed
                kind = "service" if isinstance(self.models.get(name), RewardService) \
                    else getattr(self.models.get(name), "label", "model")
                result.status[i], result.failed_by[i] = st, f"{RULE}:{requests[i].data_source}" if name == RULE \
                    else f"{kind}:{name}"
                result.failed += st != TIMEOUT
                result.timeout += st == TIMEOUT
                continue
            result.scores[i] = sum(weight * own[i][name][0] for name, weight in w.items())
        return result

    def close(self) -> None:
        try:
            self.rule.close()
        finally:
            for model in self.models.values():
                model.close()


def build_judger(cfg: RewardConfig, *, api_key: Optional[str], log_dir: str):
    """The rule Judger alone, or with reward.models: the ComposedJudger over it and the models (launched now)."""
    rule = Judger(cfg)
    if not cfg.models and not cfg.services:
        return rule
    models: dict = {name: RewardService(name, scfg) for name, scfg in cfg.services.items()}
    try:
        for name, mcfg in cfg.models.items():
            t0 = time.perf_counter()
            from mgrpo.components.judges import GenerativeJudge

            cls = GenerativeJudge if mcfg.kind == "generative" else RewardModel
            models[name] = cls(name, mcfg, api_key=api_key, log_dir=os.path.join(log_dir, f"reward-{name}"))
            log.info("start | reward %s %s (%d engine(s), %s) in %.1fs", models[name].label, name,
                     len(models[name].engines), mcfg.judge.openai_url or mcfg.url or mcfg.hf_path,
                     time.perf_counter() - t0)
    except BaseException:
        for m in models.values():
            m.close()
        rule.close()
        raise
    return ComposedJudger(cfg, rule, models)
