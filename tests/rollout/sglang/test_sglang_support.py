"""Each output token's sampling support (engine side): SGLang 0.5.23's `return_sampling_mask` /
`sampling_logprobs_mode` served by the CPU server and read by the client into `GenerateResult.support`
and behaviour log-probs. The supports are checked against an independent top-k-then-top-p written here
over a transformers forward, the answer against SGLang's own classes and its server kit's assertions
(sglang/test/kits/spec_server_kits.py::SpecSamplingMaskKit), and SGLang's refusals with its messages."""

from __future__ import annotations

import math

import pytest
import torch

from mgrpo.rollout.sglang import SGLangEngine, SGLangRequestError
from mgrpo.rollout.sglang.client import build_generate_payload
from mgrpo.rollout.sglang.protocol import wheel
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import VOCAB, post

REQS = [GenerateRequest(uid=i, prompt_ids=[1, (3 + i) % VOCAB, 5, 7][: 2 + i % 3]) for i in range(5)]


def reference_support(logp: torch.Tensor, top_k: int, top_p: float) -> list[int]:
    """Top-k, then top-p, of one tempered distribution, written independently of both samplers: walk the
    tokens by decreasing probability; keep one while fewer than k are kept and the mass before it is at
    most top_p."""
    probs = logp.double().exp()
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept, before = [], 0.0
    for t in order:
        if (top_k > 0 and len(kept) >= top_k) or before > top_p + 1e-6:
            break
        kept.append(t)
        before += float(probs[t])
    return sorted(kept)


@pytest.mark.integration
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.3, top_k=8, top_p=0.8, max_new_tokens=6, seed=3),
                                      SamplingParams(temperature=1.2, top_k=3, max_new_tokens=6, seed=4),
                                      SamplingParams(temperature=1.0, top_k=12, top_p=0.6, max_new_tokens=6, seed=5)],
                         ids=["t0.3-topk8-topp0.8", "topk3", "topk12-topp0.6"])
def test_support_and_behaviour_logprobs_match_an_independent_truncation(engine, ref, sampling):
    sampling = SamplingParams(**{**sampling.__dict__, "return_support": True})
    out = engine.generate(REQS, sampling)
    sizes = set()
    for req, res in zip(REQS, out):
        assert len(res.support) == len(res.token_ids) == sampling.max_new_tokens
        full = ref.logprobs(req.prompt_ids, res.token_ids, sampling.temperature)  # [T, vocab], tempered
        for pos, (tok, support) in enumerate(zip(res.token_ids, res.support)):
            expected = reference_support(full[pos], sampling.top_k, sampling.top_p)
            assert support == expected, (req.uid, pos)
            assert tok in support
            behaviour = full[pos][tok] - torch.logsumexp(full[pos][support], dim=0)  # renormalised over the support
            assert abs(res.logprobs[pos] - float(behaviour)) < 1e-5
            sizes.add(len(support))
    assert len(sizes) > 1 if sampling.top_p < 1 else sizes == {sampling.top_k}  # top-p cut at different places


@pytest.mark.integration
def test_whole_vocabulary_and_greedy(engine, ref):
    whole = engine.generate(REQS, SamplingParams(temperature=0.9, max_new_tokens=5, seed=7, return_support=True))
    for req, res in zip(REQS, whole):
        assert res.support == [None] * 5  # no top-k, no top-p: sampled from everything (SGLang asked for no mask)
        assert ref.max_diff(req.prompt_ids, res, 0.9) < 1e-5  # the behaviour log-probs are the plain ones
    greedy = engine.generate(REQS, SamplingParams(temperature=0.0, max_new_tokens=5, return_support=True))
    for res in greedy:
        assert res.support == [[t] for t in res.token_ids] and res.logprobs == [0.0] * 5
    plain = engine.generate(REQS, SamplingParams(temperature=0.7, top_k=4, max_new_tokens=3, seed=1))
    assert all(r.support is None for r in plain)  # not asked: not there


@pytest.mark.integration
def test_answer_is_sglangs(engine):
    """The kit's assertions on a mixed greedy/sampling batch with both log-prob modes; the request passes
    SGLang's JSON contract; the rows are what SGLang's SamplingMaskChunk.to_lists gives."""
    body = {"input_ids": [[1, 2, 3]] * 4, "rid": ["g-sel", "s-sel", "g-sup", "s-sup"],
            "sampling_params": [{"temperature": 0.0, "top_k": 1, "max_new_tokens": 7, "ignore_eos": True},
                                {"temperature": 1.0, "top_k": 10, "top_p": 0.95, "max_new_tokens": 7,
                                 "ignore_eos": True, "sampling_seed": 1}] * 2,
            "return_sampling_mask": True, "sampling_logprobs_mode": ["selected", "selected", "support", "support"]}
    if wheel.contract() is not None:
        wheel.contract().GenerateRequest.from_json_value(body)
    r = post(engine.url, "/generate", body)
    assert r.status_code == 200, r.text
    outputs = r.json()
    assert len(outputs) == 4
    for request_idx, output in enumerate(outputs):  # SpecSamplingMaskKit.test_sampling_mask's checks
        output_ids, meta = output["output_ids"], output["meta_info"]
        masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
        assert len(output_ids) == 7 and len(masks) == len(logprobs) == 7
        assert meta["output_token_sampling_mask_length"] == 7
        for output_id, mask, logprob in zip(output_ids, masks, logprobs):
            assert output_id in mask
            if request_idx >= 2:
                assert len(logprob) == len(mask) and all(math.isfinite(v) for v in logprob)
                assert abs(sum(math.exp(v) for v in logprob) - 1.0) < 1e-5
            else:
                assert math.isfinite(logprob)
            if request_idx % 2 == 0:
                assert mask == [output_id] and logprob == ([0.0] if request_idx >= 2 else 0.0)
        if request_idx == 3:  # SGLang packs a support by decreasing probability
            assert all(a >= b for lp in logprobs for a, b in zip(lp, lp[1:]))
    mod = wheel.sampling_mask()
    if mod is not None:  # the wire form: SGLang's chunk of int32 ids and float32 log-probs, read back
        import numpy as np

        masks, lps = outputs[1]["meta_info"]["output_token_sampling_mask"], \
            outputs[1]["meta_info"]["output_token_sampling_logprobs"]
        chunk = mod.SamplingMaskChunk(lengths=np.array([len(m) for m in masks], np.int32),
                                      token_ids=np.array(sum(masks, []), np.int32),
                                      logprobs=np.array(lps, np.float32))
        assert chunk.to_lists(support_logprobs=False) == (masks, lps)


@pytest.mark.integration
def test_sglangs_refusals(engine):
    def gen(extra, sp):
        return post(engine.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, **sp},
                                              **extra})

    r = gen({"return_sampling_mask": True}, {"temperature": 1.0})  # top_k -1: the whole vocabulary
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got "
        "top_k=1073741824. Lower top_k or increase --sampling-mask-max-tokens.")
    r = gen({"sampling_logprobs_mode": "support"}, {"top_k": 3})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    assert gen({"return_sampling_mask": True}, {"top_k": 4097}).status_code == 400
    assert gen({"return_sampling_mask": True, "sampling_logprobs_mode": "all"}, {"top_k": 3}).status_code == 400
    with pytest.raises(ValueError, match=r"return_support with top_p=0.9 and top_k=-1.*rollout.top_k"):
        SGLangEngine.connect(engine.url).generate(REQS[:1], SamplingParams(top_p=0.9, return_support=True))


def test_payload_asks_only_when_a_mask_is_needed():
    reqs = REQS[:2]
    ask = build_generate_payload(reqs, SamplingParams(top_k=8, return_support=True), rids=["a", "b"])
    assert ask["return_sampling_mask"] is True and ask["sampling_logprobs_mode"] == "selected"
    for sp in (SamplingParams(return_support=True), SamplingParams(top_k=8)):
        assert "return_sampling_mask" not in build_generate_payload(reqs, sp, rids=["a", "b"])


@pytest.mark.integration
def test_a_server_without_masks_fails_by_name(engine):
    """A server that ignores return_sampling_mask (older SGLang) is not silently read as 'no support'."""
    from mgrpo.rollout.sglang.generate_io import parse_generate_item

    item = {"output_ids": [3], "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                             "output_token_logprobs": [[-0.5, 3, None]]}}
    with pytest.raises(SGLangRequestError, match="no output_token_sampling_mask"):
        parse_generate_item(item, 0, 0, sampling=SamplingParams(top_k=4, return_support=True))
