"""A run's classifier reward model of 2 engines is hosted as its rollout engines are: each server in an `EngineHost`
actor in its own bundle of the run's placement group `mgrpo-reward-<name>` (read back from Ray's placement group table
and from the actors' own assigned resources); with placement=shared, engine k's host in rollout engine k's bundle of
`mgrpo-rollout`, claiming no CPU or GPU of it, and scoring as transformers does; keyed with the run's secret (a request without it is refused 401),
scores equal to transformers' forward of the checkpoint; a SIGKILLed server is found by its host's health check,
started again in the same bundle (counted in reward/model_restarts). A judge of 2 engines is scored through SGLang's
router (keyed, listing both servers), its answers equal to the model's own softmax; a SIGKILLed judge server is
restarted through its host and re-registered with the router."""

from __future__ import annotations

import dataclasses
import re

import pytest
import requests
import torch

from mgrpo.rewards.failed import OK
from mgrpo.config.reward import RewardModelConfig
from mgrpo.data.synthetic import synthetic_tokenizer
from mgrpo.rewards import ScoreRequest
from tests.helpers.procs import kill_and_wait
from tests.helpers.reward_models import tiny_classifier
from tests.helpers.runs import small_config


def _bundle_of(host, claimed: bool = False):
    """(placement group id, bundle indices) of an actor, from the resources Ray assigned to its process: a bundle's
    CPU (CPU_group_<i>_<pg>), or for an actor that claims nothing of its bundle the bundle marker Ray gives it
    (bundle_group_<i>_<pg>). `claimed`: also the CPU and GPU it holds ({} for a shared reward engine's host)."""
    import ray

    def where(self):
        ctx = ray.get_runtime_context()
        return ctx.get_placement_group_id(), sorted(ctx.worker.core_worker.resource_ids()), \
            ctx.get_assigned_resources()

    pg, names, held = ray.get(host.__ray_call__.remote(where))
    at = pg, {int(m.group(1)) for n in names if (m := re.match(r"(?:CPU|bundle)_group_(\d+)_", n))}
    return (*at, {k: v for k, v in held.items() if k in ("CPU", "GPU")}) if claimed else at


def _reference(hf_dir: str, reqs: list[ScoreRequest]) -> list[float]:
    """transformers' forward of prompt + response (+ EOS when stopped), tokenised by hand."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = synthetic_tokenizer()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([tok.encode(r.prompt + r.response) + [1]])).logits[0, 0])
                for r in reqs]


@pytest.mark.integration
def test_reward_engines_in_the_runs_placement_group_keyed_and_restarted(tmp_path):
    import ray

    from mgrpo.cluster.placement import place
    from mgrpo.cluster.ray_env import stop_ray
    from mgrpo.cluster.aux_engines import RewardEngines
    from mgrpo.rewards import build_rubric
    from mgrpo.config.validate import layout, resolve_device
    from mgrpo.rollout.sglang.auth import resolve_api_key

    hf_dir = tiny_classifier(str(tmp_path / "rm"))
    cfg = small_config(str(tmp_path / "run"), rollout={"num_engines": 2})
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(
        cfg.reward, num_workers=0, compose={"mgrpo/sum": {"rm": 1.0}},
        models={"rm": RewardModelConfig(hf_path=hf_dir, engines=2, batch_size=2, timeout_s=30),
                # placement=shared: engine k in rollout engine k's bundle (the same checkpoint, scored directly)
                "shared": RewardModelConfig(hf_path=hf_dir, engines=2, batch_size=4, timeout_s=30,
                                            placement="shared")}))
    cfg = resolve_device(cfg)
    reqs = [ScoreRequest("mgrpo/sum", resp, str(eval(p[:-1])), {"finish_reason": "stop"}, prompt=p)
            for p, resp in [("2+3=", "5"), ("2+3=", "4"), ("1+1=", "2"), ("4+4=", "8"), ("3+1=", "41"), ("1+2=", "")]]
    want = _reference(hf_dir, reqs)
    key = resolve_api_key("auto", environ={})
    placement = judger = None
    try:
        placement = place(cfg, layout(cfg))
        judger = build_rubric(cfg.reward, engines=RewardEngines(), api_key=key, log_dir=str(tmp_path / "logs"),
                              placement=placement, cpus=cfg.trainer.cpus_per_worker)
        rm = judger.scorers["rm"]

        # in the run's placement group, one bundle each
        table = ray.util.placement_group_table(placement.reward["rm"].pg)
        assert table["name"] == "mgrpo-reward-rm" and table["state"] == "CREATED" and len(table["bundles"]) == 2
        pg_id = placement.reward["rm"].pg.id.hex()
        assert [_bundle_of(h) for h in rm.hosting.hosts] == [(pg_id, {0}), (pg_id, {1})]
        assert len({a["url"] for a in rm.hosting.addresses}) == 2 and all(a["pid"] for a in rm.hosting.addresses)
        assert "shared" not in placement.reward  # no placement group of its own...
        shared = judger.scorers["shared"]
        table = ray.util.placement_group_table(placement.rollout.pg)  # ...it sits in the rollout engines' bundles
        assert table["name"] == "mgrpo-rollout" and table["state"] == "CREATED" and len(table["bundles"]) == 2
        rollout_pg = table["placement_group_id"]
        assert [_bundle_of(h, claimed=True) for h in shared.hosting.hosts] == [(rollout_pg, {0}, {}), (rollout_pg, {1}, {})]
        assert len({a["url"] for a in shared.hosting.addresses} | {a["url"] for a in rm.hosting.addresses}) == 4
        got = shared.score(reqs)
        scores, status = got.scores, got.status
        assert status == [OK] * 6 and scores == pytest.approx(want, abs=1e-5)

        # keyed: each server refuses a request without the run's key, and answers the run's client
        ids = [rm.inputs(r) for r in reqs]
        for k, url in enumerate(rm.hosting.urls):
            assert requests.post(f"{url}/classify", json={"input_ids": ids}, timeout=30).status_code == 401, url
            assert [v[0] for v in rm.hosting.engines[k].classify(ids)] == pytest.approx(want, abs=1e-5)
        # a classifier's /classify goes to its servers in turn (the router has no route for a reward head's score)
        assert rm.hosting.front is None
        got = judger.score(reqs)
        assert got.status == [OK] * 6 and got.scores == pytest.approx(want, abs=1e-5)
        assert got.measured["reward/model_restarts"] == 0

        # a SIGKILLed server: restarted through its host, in the same bundle, counted, re-registered
        old_url, old_pid = rm.hosting.addresses[0]["url"], rm.hosting.addresses[0]["pid"]
        kill_and_wait(old_pid)
        got = judger.score(reqs)
        assert got.status == [OK] * 6 and got.scores == pytest.approx(want, abs=1e-5)
        assert got.measured["reward/model_restarts"] == 1 and rm.restarts == 1
        assert rm.hosting.addresses[0]["pid"] != old_pid and rm.hosting.urls[0] != old_url
        assert _bundle_of(rm.hosting.hosts[0]) == (pg_id, {0})
        assert requests.post(f"{rm.hosting.urls[0]}/classify", json={"input_ids": ids}, timeout=30).status_code == 401
    finally:
        if judger is not None:
            judger.close()
        if placement is not None:
            placement.remove()
        stop_ray()


@pytest.mark.integration
def test_judge_engines_behind_the_router_keyed_and_restarted(tmp_path):
    import ray

    from mgrpo.cluster.placement import place
    from mgrpo.cluster.ray_env import stop_ray
    from mgrpo.cluster.aux_engines import RewardEngines
    from mgrpo.rewards.generative import GenerativeJudge
    from mgrpo.config.schema import ModelConfig
    from mgrpo.rewards.judge import compile_template, render
    from mgrpo.config.reward import JudgeConfig
    from mgrpo.config.validate import layout, resolve_device
    from mgrpo.data.printable import printable_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint
    from mgrpo.rollout.sglang.auth import resolve_api_key

    d = str(tmp_path / "judge")
    init_hf_checkpoint(d, ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512,
                                      init_std=0.1), seed=0, tokenizer=printable_tokenizer())
    template = "Q:{{ question }}\nA:{{ response }}\nRight? Y or N"
    jcfg = RewardModelConfig(kind="generative", hf_path=d, engines=2, timeout_s=60, judge=JudgeConfig(
        template=template, parser="yes_no", yes="Y", no="N",
        top_logprobs=107))
    cfg = small_config(str(tmp_path / "run"))
    cfg = resolve_device(dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, num_workers=0,
                                                                             models={"judge": jcfg})))
    reqs = [ScoreRequest("mgrpo/sum", r, gt, extra_info={"finish_reason": "stop"},
                         prompt=[{"role": "user", "content": q}])
            for q, r, gt in [("1+2=", "3", "3"), ("4+4=", "9", "8"), ("2+0=", "2", "2"), ("3+1=", "so 4", "4")]]
    # the reference: the model's own next-token softmax after the judge's prompt, P(Y) / (P(Y) + P(N))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = printable_tokenizer()
    y, n = (tok.convert_tokens_to_ids(t) for t in ("Y", "N"))
    want = []
    with torch.no_grad():
        for r in reqs:
            user = render(compile_template(template), prompt=r.prompt, response=r.response, reference=r.ground_truth,
                          rubric="")
            ids = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            want.append(float(p[y] / (p[y] + p[n])))
    placement = judge = None
    try:
        placement = place(cfg, layout(cfg))
        judge = GenerativeJudge("judge", jcfg, engines=RewardEngines(), api_key=resolve_api_key("auto", environ={}),
                                log_dir=str(tmp_path / "logs"), placement=placement, cpus=1)
        pg_id = placement.reward["judge"].pg.id.hex()
        assert [_bundle_of(h) for h in judge.hosting.hosts] == [(pg_id, {0}), (pg_id, {1})]
        router = judge.hosting.front.router
        assert set(router.workers()) == set(judge.hosting.urls)
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
        for url in [router.url, *judge.hosting.urls]:
            assert requests.post(f"{url}/generate", json=body, timeout=30).status_code == 401, url
        got = judge.score(reqs)
        scores, status = got.scores, got.status
        assert status == [OK] * 4 and scores == pytest.approx(want, abs=1e-5)

        old_pid, old_url = judge.hosting.addresses[1]["pid"], judge.hosting.urls[1]
        kill_and_wait(old_pid)
        got = judge.score(reqs)
        scores, status = got.scores, got.status
        assert status == [OK] * 4 and scores == pytest.approx(want, abs=1e-5)
        assert judge.restarts == 1 and judge.hosting.urls[1] != old_url and _bundle_of(judge.hosting.hosts[1]) == (pg_id, {1})
        assert set(router.workers()) == set(judge.hosting.urls)  # the router now routes to the new server
        assert ray.get(judge.hosting.hosts[1].address.remote())["url"] == judge.hosting.urls[1]
    finally:
        if judge is not None:
            judge.close()
        if placement is not None:
            placement.remove()
        stop_ray()
