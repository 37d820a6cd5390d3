"""The rubric: every scorer of a run composed per data_source by reward.compose, a weighted sum.

The scorers are the rules (`Rules`, the reward function of each data_source, in worker processes), the reward models
(`RewardModel`), the generative judges (`GenerativeJudge`) and the HTTP reward services (`RewardService`), all one
protocol (scoring.py). Every scorer's own mean is reported (reward/<scorer>/mean), the rule's too where it has weight
0, so reward hacking shows when the two part. A sample whose weighted scorer failed has no reward, never 0 (a weight-0
rule cannot fail it). With rules alone the rubric is the rules.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence

from mgrpo.config.reward import RewardConfig
from mgrpo.rewards.registry import EVERY_SOURCE, reward_functions
from mgrpo.rewards.rules import Rules
from mgrpo.rewards.scoring import OK, ScoreRequest, ScoreResult, Scorer

log = logging.getLogger("mgrpo")

RULE = "rule"


class Rubric:
    """Scores each request by the weighted sum of its data_source's scorers (reward.compose; the rule alone, weight
    1, where it names none)."""

    def __init__(self, cfg: RewardConfig, rules: Rules, scorers: Optional[dict[str, Scorer]] = None):
        """`scorers`: name -> a RewardModel, GenerativeJudge or RewardService."""
        self.cfg, self.rules, self.scorers = cfg, rules, dict(scorers or {})
        fns = reward_functions(cfg)
        self._has_rule = lambda src: src in fns or EVERY_SOURCE in fns  # noqa: E731

    @property
    def models_score(self) -> bool:
        """Scorers beyond the rules (reward models, judges, services) take part: they call servers, so the loop
        judges in a driver thread while the trainer's forwards run."""
        return bool(self.scorers)

    def weights(self, data_source: str) -> dict[str, float]:
        return dict(self.cfg.compose.get(data_source) or self.cfg.compose.get(EVERY_SOURCE) or {RULE: 1.0})

    def restarts(self) -> int:
        """Servers of the scorers started again since they were launched."""
        return sum(getattr(s, "restarts", 0) for s in self.scorers.values())

    def score(self, requests: Sequence[ScoreRequest]) -> ScoreResult:
        if not self.scorers:
            return self.rules.score(list(requests))
        n = len(requests)
        weights = [self.weights(r.data_source) for r in requests]
        result = ScoreResult.empty(n)
        restarted = self.restarts()
        parts: dict[str, tuple[list[int], ScoreResult]] = {}
        # the rule: where it has weight, and at weight 0 where one exists (what the task says, next to the model)
        idx = [i for i, (r, w) in enumerate(zip(requests, weights)) if RULE in w or self._has_rule(r.data_source)]
        if idx:
            parts[RULE] = (idx, self.rules.score([requests[i] for i in idx]))
            result.worker_restarts += parts[RULE][1].worker_restarts
        for name, scorer in self.scorers.items():
            idx = [i for i, w in enumerate(weights) if name in w]
            if idx:
                t0 = time.perf_counter()
                parts[name] = (idx, scorer.score([requests[i] for i in idx]))
                dt = time.perf_counter() - t0
                result.measured[f"reward/{name}/seconds"] = dt
                result.measured[f"reward/{name}/samples_per_s"] = len(idx) / max(dt, 1e-9)
        # servers started again during this call (a run-long counter: reward/model_restarts_total)
        result.measured["reward/model_restarts"] = float(self.restarts() - restarted)
        own: list[dict[str, tuple[Optional[float], str, str]]] = [{} for _ in range(n)]
        for name, (idx, got) in parts.items():
            result.measured.update(got.measured)  # a judge's own counts (unparsed answers, disagreements)
            result.components[name] = [None] * n
            for k, i in enumerate(idx):
                own[i][name] = (got.scores[k], got.status[k], got.failed_by[k])
                result.components[name][i] = got.scores[k] if got.status[k] == OK else None
            result.errors.extend(got.errors[:3])
        for i, w in enumerate(weights):
            failed = next((own[i][name] for name in w if own[i][name][1] != OK), None)
            if failed is not None:  # a scorer with weight failed: no reward
                result.scores[i], result.status[i], result.failed_by[i] = None, failed[1], failed[2]
                result.failed += failed[1] != "timeout"
                result.timeout += failed[1] == "timeout"
                continue
            result.scores[i] = sum(weight * own[i][name][0] for name, weight in w.items())
        return result

    def close(self) -> None:
        try:
            self.rules.close()
        finally:
            for scorer in self.scorers.values():
                scorer.close()


def build_rubric(cfg: RewardConfig, *, engines=None, api_key: Optional[str] = None, log_dir: str = "",
                 placement=None, shared_devices: Optional[list] = None, cpus: float = 1) -> Rubric:
    """The run's rubric: the rules, and reward.services and reward.models (their servers launched now through
    `engines`, an `EngineKit`, in `placement`'s reward bundles, or on the rollout engines' with placement=shared:
    `shared_devices[i]` the accelerator ids of rollout engine i, or None)."""
    from mgrpo.rewards.generative import GenerativeJudge
    from mgrpo.rewards.models import RewardModel
    from mgrpo.rewards.service import RewardService

    rules = Rules(cfg)
    scorers: dict = {}
    try:
        scorers.update({name: RewardService(name, scfg) for name, scfg in cfg.services.items()})
        for name, mcfg in cfg.models.items():
            t0 = time.perf_counter()
            cls = GenerativeJudge if mcfg.kind == "generative" else RewardModel
            devices = None
            if shared_devices and str(mcfg.placement) == "shared":
                devices = [shared_devices[k % len(shared_devices)] for k in range(mcfg.engines)]
                devices = devices if all(devices) else None
            scorers[name] = cls(name, mcfg, engines, api_key=api_key, log_dir=os.path.join(log_dir, f"reward-{name}"),
                                placement=placement, devices=devices, cpus=cpus)
            hosting = getattr(scorers[name], "hosting", None)
            log.info("start | reward %s %s (%d engine(s), %s) in %.1fs", scorers[name].label, name,
                     len(hosting.engines) if hosting else 0, mcfg.judge.openai_url or mcfg.url or mcfg.hf_path,
                     time.perf_counter() - t0)
    except BaseException:
        for s in scorers.values():
            s.close()
        rules.close()
        raise
    return Rubric(cfg, rules, scorers)
