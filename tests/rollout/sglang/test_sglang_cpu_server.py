"""The CPU rollout server, launched as a subprocess by `SGLangEngine.launch`, through the same
client the GPU path uses: generation against an independent transformers forward, SGLang's answer
contract, abort, memory release/resume, hang and kill detection. One server per module."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests
import torch

from mgrpo.rollout.sglang import SGLangEngine, SGLangRequestError
from mgrpo.rollout.sglang.client import build_generate_payload
from mgrpo.rollout.sglang.protocol import wheel
from mgrpo.rollout.sglang.server import CPU_MODULE, sglang_runtime_missing
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import VOCAB, FaultProxy, launch, perturbed, post


def _requests(n=6):  # prompts of different lengths: the server pads them in one batch
    return [GenerateRequest(uid=i, prompt_ids=[1, (3 + i) % VOCAB, 5, 7][: 2 + i % 3]) for i in range(n)]


@pytest.mark.integration
def test_launch_runs_the_cpu_server_where_sglang_cannot(engine):
    assert sglang_runtime_missing() is not None  # this machine: no CUDA
    assert engine.server_module == CPU_MODULE and engine.process.poll() is None
    assert engine.health().ok


@pytest.mark.integration
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                      SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7, seed=3),
                                      SamplingParams(temperature=1.3, max_new_tokens=5, seed=4)],
                         ids=["greedy", "t0.7-topp-topk", "t1.3"])
def test_generated_logprobs_match_a_transformers_forward(engine, ref, sampling):
    reqs = _requests()
    out = engine.generate(reqs, sampling)
    assert [r.uid for r in out] == [r.uid for r in reqs]
    for req, res in zip(reqs, out):
        assert len(res.token_ids) == sampling.max_new_tokens and res.finish_reason == "length"
        assert ref.max_diff(req.prompt_ids, res, sampling.temperature) < 1e-5
        lp = ref.logprobs(req.prompt_ids, res.token_ids, sampling.temperature)
        if sampling.greedy:
            assert res.token_ids == lp.argmax(-1).tolist()
        elif sampling.top_k > 0:  # every sampled token is among the top k of its position
            ranks = (lp > lp.gather(-1, torch.tensor(res.token_ids)[:, None])).sum(-1)
            assert int(ranks.max()) < sampling.top_k


@pytest.mark.integration
def test_seeded_requests_do_not_depend_on_the_batch(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    batch = engine.generate(_requests(6), sp)
    alone = engine.generate([_requests(6)[4]], sp)
    assert alone[0].token_ids == batch[4].token_ids  # same seed, same tokens (log-probs: padding moves the last bits)
    assert torch.allclose(torch.tensor(alone[0].logprobs), torch.tensor(batch[4].logprobs), atol=1e-5)
    same_prompt = engine.generate([GenerateRequest(uid=u, prompt_ids=[1, 4, 5]) for u in range(4)], sp)
    assert len({tuple(r.token_ids) for r in same_prompt}) > 1  # n copies of one prompt get different seeds


@pytest.mark.integration
def test_stop_tokens_end_a_response_and_are_kept(engine, ckpt):
    stops = list(range(3, VOCAB))  # almost every token stops: responses end at once
    body = build_generate_payload(_requests(4), SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
                                  rids=[f"s{i}" for i in range(4)], stop_token_ids=stops)
    items = post(engine.url, "/generate", body).json()
    for it in items:
        fin, ids = it["meta_info"]["finish_reason"], it["output_ids"]
        if fin["type"] == "stop":
            assert ids[-1] in stops and fin["matched"] == ids[-1] and all(t not in stops for t in ids[:-1])
        else:
            assert fin == {"type": "length", "length": 8} and not set(ids) & set(stops)
    assert any(it["meta_info"]["finish_reason"]["type"] == "stop" for it in items)


@pytest.mark.integration
def test_answers_follow_sglangs_own_contract(engine):
    contract = wheel.contract()
    if contract is None:
        pytest.skip("sglang wheel or msgspec missing (pip install --no-deps -r requirements-sglang.txt)")
    body = build_generate_payload(_requests(3), SamplingParams(temperature=0.5, max_new_tokens=4, seed=1),
                                  rids=["a", "b", "c"])
    contract.GenerateRequest.from_json_value(body)  # what we send is valid for SGLang
    items = post(engine.url, "/generate", body).json()
    for rid, it in zip("abc", items):
        resp = contract.GenerateResponse.from_json_value(it)
        assert resp.meta_info.id == rid and resp.meta_info.weight_version == "0"
        assert [e.token_id for e in resp.meta_info.output_token_logprobs] == list(resp.output_ids)
    single = post(engine.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
                                            "return_logprob": True}).json()
    assert isinstance(single, dict) and len(single["output_ids"]) == 2
    info = engine.client.get("/get_model_info").json()
    contract.GetModelInfoResponse.from_json_value(info)


@pytest.mark.integration
def test_bad_requests_are_refused_with_the_reason(engine):
    r = post(engine.url, "/generate", {"input_ids": [[1, 2]], "sampling_params": {"temprature": 1.0}})
    assert r.status_code == 400 and "temprature" in r.text
    eng = SGLangEngine.connect(engine.url, max_retries=3)
    with pytest.raises(SGLangRequestError, match=r"HTTP 400.*outside the vocabulary") as e:
        eng.generate([GenerateRequest(uid=0, prompt_ids=[1, VOCAB + 5])], SamplingParams(max_new_tokens=2))
    assert e.value.status == 400 and eng.retries == 0  # a client error is not retried
    r = post(engine.url, "/update_weight_version", {"new_version": 3})  # SGLang's struct: a string
    assert r.status_code == 400 and "new_version" in r.json()["message"]  # SGLang's ErrorResponse
    r = post(engine.url, "/begin_weight_update", {"selectr": "all"})
    assert r.status_code == 400 and "selectr" in r.text


@pytest.mark.integration
def test_transient_5xx_is_retried_then_served(engine):
    with FaultProxy(engine.url) as proxy:
        proxy.inject["/generate"] = [503, 502]
        eng = SGLangEngine.connect(proxy.url, max_retries=3, retry_backoff_s=0.01)
        out = eng.generate(_requests(3), SamplingParams(temperature=0.0, max_new_tokens=3))
        assert len(out) == 3 and eng.stats["generate_retries"] == 2 and eng.retries == 2
        proxy.inject["/generate"] = [503] * 5
        with pytest.raises(SGLangRequestError, match=r"failed after 3 attempts \(retry budget 2\).*HTTP 503"):
            eng = SGLangEngine.connect(proxy.url, max_retries=2, retry_backoff_s=0.01)
            eng.generate(_requests(1), SamplingParams())


@pytest.mark.integration
def test_timed_out_batch_is_aborted_on_the_server_then_resent(engine):
    """The client gives up on a slow answer, aborts its rids on the server (so that no second copy
    runs), and resends under fresh rids; the held-back first copy then arrives aborted."""
    with FaultProxy(engine.url) as proxy:
        proxy.delay["/generate"] = [1.5]
        eng = SGLangEngine.connect(proxy.url, max_retries=1, request_timeout_s=0.5, retry_backoff_s=0.01)
        out = eng.generate(_requests(2), SamplingParams(temperature=0.0, max_new_tokens=4))
        assert [r.uid for r in out] == [0, 1] and all(len(r.token_ids) == 4 for r in out)
        assert eng.stats["generate_retries"] == 1
        assert proxy.seen.count("/abort_request") == 2 and proxy.seen.count("/generate") == 2


@pytest.mark.integration
def test_batches_split_and_reassemble_in_uid_order(engine):
    with FaultProxy(engine.url) as proxy:
        eng = SGLangEngine.connect(proxy.url, batch_size=3, concurrency=2)
        out = eng.generate(_requests(8)[::-1], SamplingParams(temperature=0.0, max_new_tokens=3))
        assert [r.uid for r in out] == list(range(8)) and proxy.seen.count("/generate") == 3
        h = eng.health()
        assert h.ok and h.detail["server_weight_version"] == str(engine.weight_version)


def _long_body(n: int, rids):
    return {"rid": rids, "input_ids": [[1, 2 + i % 5] for i in range(n)], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}}


@pytest.mark.integration
def test_abort_one_request_mid_generation(engine):
    rids = [f"long{i}" for i in range(24)]
    box = {}
    th = threading.Thread(target=lambda: box.update(items=post(engine.url, "/generate", _long_body(24, rids)).json()))
    th.start()
    time.sleep(0.4)
    assert post(engine.url, "/abort_request", {"rid": "long3"}).status_code == 200
    th.join(timeout=60)
    items = box["items"]
    fin = items[3]["meta_info"]["finish_reason"]
    assert fin["type"] == "abort" and 0 < len(items[3]["output_ids"]) < 240, fin
    assert all(it["meta_info"]["finish_reason"] == {"type": "length", "length": 240}
               for i, it in enumerate(items) if i != 3)


@pytest.mark.integration
def test_client_resends_what_the_server_aborted(engine, ref):
    eng = SGLangEngine.connect(engine.url, max_retries=2)
    reqs = [GenerateRequest(uid=i, prompt_ids=[1, 2 + i % 5]) for i in range(24)]
    box = {}
    th = threading.Thread(target=lambda: box.update(out=eng.generate(reqs, SamplingParams(temperature=1.0,
                                                                                            max_new_tokens=200))))
    th.start()
    time.sleep(0.4)
    engine.abort_all()
    th.join(timeout=60)
    out = box["out"]
    assert [r.uid for r in out] == list(range(24)) and eng.stats["aborted_retries"] == 24
    assert all(len(r.token_ids) == 200 for r in out)  # no EOS in the tiny model's config: all run to the end
    assert ref.max_diff(reqs[5].prompt_ids, out[5], 1.0) < 1e-5


@pytest.mark.integration
def test_a_cut_is_answered_as_aborted_not_retried(engine):
    """rollout.over_sample_rate's cut: abort_all(cut=True) on the client that is generating ends its requests in
    flight with SGLang's answer for an aborted running request, which the client hands back as finish_reason
    'abort' (counted in stats['cut']) instead of sending them again; an abort of a rid the server does not hold
    is ignored, as SGLang's tokenizer manager ignores it."""
    assert post(engine.url, "/abort_request", {"rid": "later0"}).status_code == 200  # not in flight: no effect
    items = post(engine.url, "/generate", {**_long_body(1, ["later0"]), "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}}).json()
    assert items[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}

    box = {}
    th = threading.Thread(target=lambda: box.update(items=post(engine.url, "/generate", _long_body(4, [
        f"cutme-{i}" for i in range(4)])).json()))
    th.start()
    time.sleep(0.05)
    assert post(engine.url, "/abort_request", {"rid": "cutme"}).status_code == 200  # no such rid: ignored
    # until the server holds cutme-1 (an abort that comes first is ignored, as above): a fixed sleep lost the race
    # on a fast machine, where 240 tokens of the tiny model took under 0.4 s
    deadline = time.monotonic() + 60
    while th.is_alive() and time.monotonic() < deadline:
        assert post(engine.url, "/abort_request", {"rid": "cutme-1"}).status_code == 200
        time.sleep(0.01)
    th.join(timeout=60)
    fin = [it["meta_info"]["finish_reason"] for it in box["items"]]
    assert fin[1] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT()
    assert [f["type"] for f in fin] == ["length", "abort", "length", "length"]

    eng = SGLangEngine.connect(engine.url, max_retries=2)
    reqs = [GenerateRequest(uid=i, prompt_ids=[1, 2 + i % 5]) for i in range(24)]
    th = threading.Thread(target=lambda: box.update(out=eng.generate(reqs, SamplingParams(temperature=1.0,
                                                                                            max_new_tokens=200))))
    th.start()
    time.sleep(0.4)
    eng.abort_all(cut=True)
    th.join(timeout=60)
    out = box["out"]
    assert [r.uid for r in out] == list(range(24)) and all(r.finish_reason == "abort" and not r.token_ids for r in out)
    assert eng.stats["cut"] == 24 and eng.stats["aborted_retries"] == 0


@pytest.mark.integration
def test_release_and_resume_memory(engine, ref):
    engine.release_memory()
    h = engine.health()
    assert h.ok and h.detail["released"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(SGLangRequestError, match="released"):
        engine.generate(_requests(1), SamplingParams(max_new_tokens=2))
    engine.resume_memory()
    # --enable-memory-saver (launch's default) really freed the weights: they must come back first
    with pytest.raises(SGLangRequestError, match="not loaded since"):
        engine.generate(_requests(1), SamplingParams(max_new_tokens=2))
    assert post(engine.url, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 400  # not released
    new = perturbed(ref.state(), 1)
    engine.update_weights(new)
    engine.finish_weight_update(1)
    ref.load(new)
    out = engine.generate(_requests(3), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert all(r.weight_version == 1 for r in out)
    assert max(ref.max_diff(q.prompt_ids, r, 0.0) for q, r in zip(_requests(3), out)) < 1e-5


@pytest.mark.integration
def test_health_detects_a_hung_and_a_killed_server(ckpt, tmp_path):
    eng = launch(ckpt, str(tmp_path), health_timeout_s=1.0)
    try:
        assert eng.health().ok
        os.killpg(eng.process.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        h = eng.health()
        assert not h.ok and "Timeout" in h.detail["error"] and time.monotonic() - t0 < 5
        os.killpg(eng.process.pid, signal.SIGCONT)
        assert eng.health().ok
        os.killpg(eng.process.pid, signal.SIGKILL)
        eng.process.wait(timeout=10)
        h = eng.health()
        assert not h.ok and "exited with code -9" in h.detail["error"]
        with pytest.raises(SGLangRequestError, match="server is gone"):
            eng.generate(_requests(1), SamplingParams(max_new_tokens=2))
    finally:
        eng.shutdown()


@pytest.mark.integration
def test_shutdown_stops_the_server(engine):
    """Last in the module: the fixture's own shutdown is then a no-op."""
    engine.shutdown()
    assert engine.process.poll() is not None
    h = engine.health()
    assert not h.ok and "exited" in h.detail["error"]
    with pytest.raises(requests.ConnectionError):  # nothing listens on the port any more
        post(engine.url, "/health", timeout=2)
