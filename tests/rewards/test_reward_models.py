"""Reward models as judges: the composed reward equals rule + weight x the model's own forward on the conversation
formatted with the model's tokenizer; a 5xx, an answer that is not SGLang's and a service that hangs leave their
samples without a score (failed / timeout, by 'model:<name>'), never 0; a reward engine killed between calls is
started again and counted."""

from __future__ import annotations


import pytest
import torch

from mgrpo.rewards.failed import OK, TIMEOUT
from mgrpo.cluster.ray_env import stop_ray
from mgrpo.cluster.aux_engines import RewardEngines
from mgrpo.rewards import Rubric
from mgrpo.rewards.models import RewardModel
from mgrpo.config.reward import RewardConfig, RewardModelConfig
from mgrpo.data.synthetic import synthetic_tokenizer
from mgrpo.rewards import Rules, ScoreRequest
from tests.helpers.procs import kill_and_wait
from tests.helpers.reward_models import tiny_classifier
from tests.helpers.sglang_cpu import FaultProxy

ENGINES = RewardEngines()


def _requests() -> list[ScoreRequest]:
    cases = [("2+3=", "5", "stop"), ("2+3=", "4", "stop"), ("1+1=", "2", "length"), ("4+4=", "8", "stop"),
             ("0+0=", "0", "stop"), ("3+1=", "41", "stop"), ("1+2=", "", "stop"), ("4+0=", "4", "stop")]
    return [ScoreRequest("mgrpo/sum", resp, str(eval(p[:-1])), {"finish_reason": fr}, prompt=p)
            for p, resp, fr in cases]


def _reference(hf_dir: str, reqs: list[ScoreRequest]) -> list[float]:
    """transformers' forward of prompt + response (+ EOS when stopped), tokenised by hand."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = synthetic_tokenizer()
    out = []
    with torch.no_grad():
        for r in reqs:
            ids = tok.encode(r.prompt + r.response) + ([1] if r.extra_info["finish_reason"] == "stop" else [])
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


@pytest.mark.integration
def test_composed_reward_failures_and_restart(tmp_path):
    hf_dir = tiny_classifier(str(tmp_path / "rm"))
    reqs = _requests()
    want = _reference(hf_dir, reqs)
    rule = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    cfg = RewardConfig(num_workers=0, compose={"mgrpo/sum": {"rule": 1.0, "rm": 0.5}},
                       models={"rm": RewardModelConfig(hf_path=hf_dir, batch_size=3)})
    launched = RewardModel("rm", cfg.models["rm"], engines=ENGINES, api_key=None, log_dir=str(tmp_path / "logs"))
    judger = Rubric(cfg, Rules(cfg), {"rm": launched})
    try:
        got = judger.score(reqs)
        assert got.status == [OK] * 8
        assert got.scores == pytest.approx([r + 0.5 * w for r, w in zip(rule, want)], abs=1e-5)
        assert got.components["rule"] == rule and got.components["rm"] == pytest.approx(want, abs=1e-5)
        assert got.measured["reward/rm/samples_per_s"] > 0 and got.measured["reward/model_restarts"] == 0

        # the same server behind a proxy that fails: each failed request's samples have no score
        with FaultProxy(launched.hosting.engines[0].url) as proxy:
            flaky = RewardModel("rm", RewardModelConfig(hf_path=hf_dir, url=proxy.url, batch_size=3, max_retries=1,
                                                        timeout_s=1.5),
                                engines=ENGINES, api_key=None, log_dir=str(tmp_path))
            faulty = Rubric(cfg, Rules(cfg), {"rm": flaky})
            proxy.inject["/classify"] = [503, 503]                       # 1st request: 503 twice, out of retries
            proxy.garbage["/classify"] = [b"not json", b'[{"embedding": "x"}]']  # 2nd: garbage, then not SGLang's
            got = faulty.score(reqs)
            assert got.status == ["failed"] * 6 + [OK] * 2 and got.failed == 6
            assert got.scores[:6] == [None] * 6 and got.failed_by[:6] == ["model:rm"] * 6
            assert got.scores[6:] == pytest.approx([r + 0.5 * w for r, w in zip(rule[6:], want[6:])], abs=1e-5)
            proxy.delay["/classify"] = [4.0, 4.0]                        # a service that hangs past timeout_s
            got = faulty.score(reqs[:3])
            assert got.status == [TIMEOUT] * 3 and got.timeout == 3 and got.scores == [None] * 3
            assert got.components["rule"] == rule[:3]                    # the rule still says what it says

        # a reward engine killed between steps is started again (through its host) before the next call
        pid = launched.hosting.addresses[0]["pid"]
        kill_and_wait(pid)
        got = judger.score(reqs)
        assert got.status == [OK] * 8 and got.measured["reward/model_restarts"] == 1
        assert got.components["rm"] == pytest.approx(want, abs=1e-5) and launched.hosting.addresses[0]["pid"] != pid
    finally:
        judger.close()
        stop_ray()  # the reward engine's host ran in the local Ray its start brought up
