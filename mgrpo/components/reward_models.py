"""Reward models on auxiliary engines, and the judger that combines them with the rules per data_source.

A reward model (reward.models.<name>) is a sequence classifier served as SGLang serves one: `--is-embedding`,
scored through `/classify` (on CPU the CPU server does the same over transformers, rollout/sglang/cpu/classify.py).
Its servers are hosted as rollout engines are (reward_engines.py: `EngineHost` actors in the run's placement groups,
the run's API key, SGLang's router in front of several); they are frozen (no weight sync, no memory release).
A call that fails health-checks the servers (behind a router: every scoring call does); one that fails the check
is started again through its host (counted: reward/model_restarts) and the call sent once more; a request that fails anyway (timeout, 5xx, an answer that is not SGLang's,
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
import time
from typing import Optional

from mgrpo.algorithms.failed_samples import OK, TIMEOUT
from mgrpo.components.judges import GenerativeJudge
from mgrpo.components.reward_engines import RewardModel
from mgrpo.config.reward import RewardConfig
from mgrpo.rewards import Judger, ScoreRequest, ScoreResult
from mgrpo.rewards.registry import EVERY_SOURCE, reward_functions
from mgrpo.rewards.service import RewardService

log = logging.getLogger("mgrpo")

RULE = "rule"


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
        restarted = self.restarts()
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
        # servers started again during this call (a run-long counter: reward/model_restarts_total)
        result.measured["reward/model_restarts"] = float(self.restarts() - restarted)
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

    def restarts(self) -> int:
        """Servers of the models started again since they were launched."""
        return sum(getattr(m, "restarts", 0) for m in self.models.values())

    def close(self) -> None:
        try:
            self.rule.close()
        finally:
            for model in self.models.values():
                model.close()


def build_judger(cfg: RewardConfig, *, api_key: Optional[str], log_dir: str, placement=None,
                 shared_devices: Optional[list] = None, cpus: float = 1):
    """The rule Judger alone, or with reward.models: the ComposedJudger over it and the models (launched now, in
    `placement`'s reward bundles, or on the rollout engines' with placement=shared: `shared_devices[i]` the
    accelerator ids of rollout engine i, or None)."""
    rule = Judger(cfg)
    if not cfg.models and not cfg.services:
        return rule
    models: dict = {name: RewardService(name, scfg) for name, scfg in cfg.services.items()}
    try:
        for name, mcfg in cfg.models.items():
            t0 = time.perf_counter()
            cls = GenerativeJudge if mcfg.kind == "generative" else RewardModel
            devices = None
            if shared_devices and str(mcfg.placement) == "shared":
                devices = [shared_devices[k % len(shared_devices)] for k in range(mcfg.engines)]
                devices = devices if all(devices) else None
            models[name] = cls(name, mcfg, api_key=api_key, log_dir=os.path.join(log_dir, f"reward-{name}"),
                               placement=placement, devices=devices, cpus=cpus)
            log.info("start | reward %s %s (%d engine(s), %s) in %.1fs", models[name].label, name,
                     len(models[name].engines), mcfg.judge.openai_url or mcfg.url or mcfg.hf_path,
                     time.perf_counter() - t0)
    except BaseException:
        for m in models.values():
            m.close()
        rule.close()
        raise
    return ComposedJudger(cfg, rule, models)
