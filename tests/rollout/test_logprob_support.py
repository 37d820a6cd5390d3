"""algorithm.logprob_support=sampled, the data path: the transformers engine's supports and behaviour
log-probs, their compact storage in the experience, and how a micro-batch lays them out (padded, THD
packed, context-parallel chunks), each against an independent reference."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from mgrpo.algorithms.support import SampleSupport
from mgrpo.training.batch import gather_tokens
from mgrpo.config import AlgorithmConfig, ConfigError, MGRPOConfig, RolloutConfig, validate
from mgrpo.experience import Experience
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams
from mgrpo.training.batch import RankBatch, batch_layout, build_micro_batch
from tests.helpers.convert import make_hf_checkpoint, tiny_cfg


# --- the in-process transformers engine --------------------------------------------------------------

def _top_k_top_p(z: torch.Tensor, k: int, p: float) -> list[int]:
    """The support of softmax(z) under top-k and top-p as SGLang's torch sampler cuts, written out: of the k
    most probable tokens (in descending order) those whose mass before them in the whole distribution is at
    most p."""
    probs, order = torch.softmax(z, -1).sort(descending=True)
    before = torch.cumsum(probs, 0) - probs
    return sorted(order[:k][before[:k] <= p].tolist())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from mgrpo.rollout.hf_engine import HFRolloutEngine

    hf_dir = make_hf_checkpoint(str(tmp_path_factory.mktemp("hf")), tiny_cfg(), seed=0)
    return HFRolloutEngine(hf_dir, eos_token_ids=[3], pad_token_id=0), hf_dir


REQUESTS = [GenerateRequest(uid=i, prompt_ids=[5 + i, 7, 9 + 2 * i][: 2 + i % 2]) for i in range(6)]


def test_engine_returns_supports_and_log_probs_over_them(engine):
    """Against a teacher-forced forward of the same tokens, with top-k / top-p written out here."""
    from transformers import AutoModelForCausalLM

    eng, hf_dir = engine
    temperature, k, p = 0.8, 7, 0.3  # p cuts inside the top 7 of the whole distribution at some steps only
    sp = SamplingParams(temperature=temperature, top_k=k, top_p=p, max_new_tokens=6, seed=1, return_support=True)
    results = eng.generate(REQUESTS, sp)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sizes = []
    for req, res in zip(REQUESTS, results):
        assert len(res.support) == len(res.token_ids) == len(res.logprobs)
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            z = model(ids).logits[0, len(req.prompt_ids) - 1:-1].double() / temperature
        for t, (tok, lp, support) in enumerate(zip(res.token_ids, res.logprobs, res.support)):
            want = _top_k_top_p(z[t], k, p)
            assert support == want, (req.uid, t)
            assert tok in support
            assert abs(lp - torch.log_softmax(z[t, want], -1)[want.index(tok)].item()) < 1e-5
            sizes.append(len(support))
    assert min(sizes) >= 1 and max(sizes) <= k and len(set(sizes)) > 1  # top-p cut some, top-k others

    # Asking does not change what is sampled; not asking returns no supports and full log-probs.
    plain = eng.generate(REQUESTS, dataclasses.replace(sp, return_support=False))
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]
    assert all(r.support is None for r in plain)
    full = torch.log_softmax(model(torch.tensor([REQUESTS[0].prompt_ids + plain[0].token_ids])).logits[0].double()
                             / temperature, -1)
    pos = len(REQUESTS[0].prompt_ids) - 1
    assert abs(plain[0].logprobs[0] - full[pos, plain[0].token_ids[0]].item()) < 1e-5
    assert plain[0].logprobs[0] < results[0].logprobs[0]  # the truncated distribution gives it more mass


def test_engine_without_truncation_reports_whole_vocabulary(engine):
    eng, _ = engine
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=2, return_support=True)
    asked, plain = eng.generate(REQUESTS, sp), eng.generate(REQUESTS, dataclasses.replace(sp, return_support=False))
    for a, b in zip(asked, plain):
        assert a.support == [None] * len(a.token_ids) and a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


# --- compact storage and micro-batch layout ------------------------------------------------------------

def _result(uid, support):
    return GenerateResult(uid=uid, token_ids=[1] * len(support), logprobs=[0.0] * len(support),
                          finish_reason="stop", weight_version=0, support=support)


def test_experience_keeps_supports_as_csr_and_refuses_missing_ones():
    from mgrpo.components.rollout_pipeline import experience_from_json, experience_to_json

    items = [type("Item", (), {"prompt_ids": [1, 2], "index": 0})()] * 2
    rows = [[[1, 4], None, [2]], [[0, 1, 2]]]
    exp = Experience.from_rollout(items, [_result(0, rows[0]), _result(1, rows[1])], n=1, want_support=True)
    assert exp.support[0].lens.tolist() == [2, 0, 1] and exp.support[0].ids.tolist() == [1, 4, 2]
    assert exp.support[0].ids.itemsize == exp.support[0].lens.itemsize == 4  # int32, not Python ints
    assert SampleSupport.from_json(exp.support[1].to_json()).ids.tolist() == [0, 1, 2]
    # an asynchronous-rollout checkpoint saves ready batches as JSON, supports included
    back = experience_from_json(json.loads(json.dumps(experience_to_json(exp))), items)
    assert [(s.lens.tolist(), s.ids.tolist()) for s in back.support] == \
        [(s.lens.tolist(), s.ids.tolist()) for s in exp.support]
    joined = Experience.concat([exp.select([1]), exp.select([0])])
    assert [s.lens.tolist() for s in joined.support] == [[3], [2, 0, 1]]
    assert Experience.from_rollout(items, [_result(0, rows[0])], n=2).support is None  # not asked
    no_support = dataclasses.replace(_result(0, rows[0]), support=None)
    with pytest.raises(RuntimeError, match="came without one .*does not implement return_support"):
        Experience.from_rollout(items, [no_support], n=1, want_support=True)
    with pytest.raises(ValueError, match="empty sampling support"):
        SampleSupport.from_tokens([[1], []])


def test_support_metrics_count_cut_and_single_id_tokens():
    """Five tokens: two cut to one id (greedy: no gradient over their support), one cut to three, two
    drawn from the whole vocabulary."""
    from mgrpo.observe.metrics import support_metrics

    m = support_metrics([SampleSupport.from_tokens([[3], [1, 2, 5], None]), SampleSupport.from_tokens([None, [7]])])
    assert m == {"rollout/support_size/mean": (1 + 3 + 1) / 3, "rollout/support_cut_frac": 3 / 5,
                 "rollout/support_single_frac": 2 / 5}


def test_gather_tokens_picks_rows_in_any_order():
    g = torch.Generator().manual_seed(0)
    rows = [[sorted(torch.randperm(20, generator=g)[:int(k)].tolist()) or None
             for k in torch.randint(0, 5, (n,), generator=g)] for n in (3, 5, 1, 4)]
    supports = [SampleSupport.from_tokens(r) for r in rows]
    flat = [r for sample in rows for r in sample]
    order = torch.randperm(len(flat), generator=g)[:9]
    offsets, ids = gather_tokens(supports, order)
    for i, j in enumerate(order.tolist()):
        assert ids[offsets[i]:offsets[i + 1]].tolist() == (flat[j] or [])


BATCH = RankBatch(input_ids=[[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]], prompt_lens=[2, 1, 3],
                  seq_index=[0, 1, 2])
# one support per response token, each holding that token (the label) plus a marker of its position
SUPPORTS = [[[t, 100 + 10 * i + j] if (i + j) % 3 else None for j, t in enumerate(ids[p:])]
            for i, (ids, p) in enumerate(zip(BATCH.input_ids, BATCH.prompt_lens))]


@pytest.mark.parametrize("packed,cp", [(False, 1), (True, 1), (True, 2), (False, 2)])
def test_micro_batch_supports_follow_their_tokens(packed, cp):
    batch = dataclasses.replace(BATCH, support=[SampleSupport.from_tokens(s) for s in SUPPORTS])
    flat = [r for sample in SUPPORTS for r in sample]
    seen = []
    for rank in range(cp):
        mb = build_micro_batch(batch, batch_layout(packed=packed, cp=cp, cp_rank=rank))
        order = mb.token_order if mb.token_order is not None else torch.arange(mb.num_tokens)
        assert mb.support_offsets.shape == (mb.num_tokens + 1,)
        for t, j in enumerate(order.tolist()):
            row = mb.support_ids[mb.support_offsets[t]:mb.support_offsets[t + 1]].tolist()
            assert row == sorted(flat[j] or []), (rank, t)
            if row:
                assert int(mb.labels[t]) in row  # the token and its support stay together
        seen += order.tolist()
    assert sorted(seen) == list(range(len(flat)))  # every token once over the CP group
    plain = build_micro_batch(BATCH, batch_layout(packed=packed, cp=cp))
    assert plain.support_offsets is None and plain.support_ids is None


def test_micro_batch_refuses_supports_of_the_wrong_length():
    bad = dataclasses.replace(BATCH, support=[SampleSupport.from_tokens(s) for s in SUPPORTS[:2]]
                              + [SampleSupport.from_tokens([None])])
    with pytest.raises(ValueError, match="support has 1 tokens for a response of 4 tokens"):
        build_micro_batch(bad)


# --- configuration -----------------------------------------------------------------------------------

def test_logprob_support_is_validated_and_a_no_op_is_logged(caplog):
    validate(MGRPOConfig(algorithm=AlgorithmConfig(logprob_support="sampled")))
    with pytest.raises(ConfigError, match=r"algorithm.logprob_support='topk' is not one of \['full', 'sampled'\]"):
        validate(MGRPOConfig(algorithm=AlgorithmConfig(logprob_support="topk")))
    from mgrpo.components.experience_maker import ExperienceMaker

    def maker(cfg):  # the part that asks the engines for supports
        return ExperienceMaker(cfg, tokenizer=None, train_data=None, rubric=None, rollout=None)

    sampled = AlgorithmConfig(logprob_support="sampled")
    with caplog.at_level(logging.INFO, logger="mgrpo"):
        assert maker(MGRPOConfig(algorithm=sampled)).sampling(0).return_support
    assert sum("changes nothing" in r.message for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mgrpo"):
        maker(MGRPOConfig(algorithm=sampled, rollout=RolloutConfig(top_k=5)))
        maker(MGRPOConfig(algorithm=sampled, rollout=RolloutConfig(top_p=0.9)))
        assert not maker(MGRPOConfig(rollout=RolloutConfig(top_p=0.9))).sampling(0).return_support
    assert not any("changes nothing" in r.message for r in caplog.records)
