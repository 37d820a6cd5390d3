"""On-policy distillation: the reverse-KL advantage term against numbers computed by hand, the refusals at start,
the planner's teacher rows, and the CPU server's input-token log-probs (SGLang's logprob_start_len) against a
plain transformers forward of the same checkpoint."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from mgrpo.config import MGRPOConfig, ModelConfig
from mgrpo.experience import Experience


def _exp(teacher: list[list[float]], rollout: list[list[float]], rewards: list[float], **kw) -> Experience:
    n = len(rewards)
    return Experience(prompt_ids=[[1, 2]] * n, response_ids=[[3] * len(r) for r in rollout], rollout_logprobs=rollout,
                      finish_reasons=["stop"] * n, weight_versions=[0] * n, group_index=[i // 2 for i in range(n)],
                      rewards=rewards, scores=rewards, in_loss=[True] * n, teacher_logprobs=teacher, **kw)


def test_reverse_kl_term_is_added_to_grpo_advantages_token_by_token():
    cfg = MGRPOConfig()
    cfg.algorithm.opd.coef = 0.5
    rollout = [[-1.0, -2.0], [-0.5], [-3.0, -1.0, -0.25], [-2.0]]
    teacher = [[-0.5, -2.5], [-0.5], [-1.0, -1.0, -4.25], [-0.1]]
    exp = _exp(teacher, rollout, [1.0, 0.0, 0.0, 1.0])
    exp.compute_advantages(cfg)
    # GRPO by hand: groups (1, 0) and (0, 1), mean 0.5, unbiased std sqrt(0.5); advantage (r - 0.5) / (std + 1e-6)
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = [[g - 0.5 * (-0.5), g - 0.5 * 0.5], [-g - 0.0], [-g - 0.5 * -2.0, -g - 0.0, -g - 0.5 * 4.0],
            [g - 0.5 * -1.9]]
    for got, w in zip(exp.advantages, want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_pure_distillation_and_context_tokens_carry_no_term():
    cfg = MGRPOConfig()
    cfg.algorithm.adv_estimator = "none"
    rollout = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]]
    teacher = [[-0.25, -2.0, -3.0], [-2.0, -2.0, -2.0]]
    exp = _exp(teacher, rollout, [1.0, 0.0], sampled_mask=[[1, 0, 1], [1, 1, 1]])
    exp.compute_advantages(cfg)
    # advantage = -(student - teacher): the teacher likes token 0 better (+0.75), token 2 worse (-2.5)
    np.testing.assert_allclose(exp.advantages[0], [0.75, 0.0, -2.5], atol=1e-6)  # the context token: 0
    np.testing.assert_allclose(exp.advantages[1], [-1.0, -1.0, -1.0], atol=1e-6)
    # veRL's clamps: log-probs from below, then the per-token KL to [-c, c]
    cfg.algorithm.opd = dataclasses.replace(cfg.algorithm.opd, log_prob_min_clamp=-2.5, loss_max_clamp=0.5)
    exp.compute_advantages(cfg)
    np.testing.assert_allclose(exp.advantages[0], [0.5, 0.0, -0.5], atol=1e-6)  # KL -0.75, 2.0 clamped


def test_opd_metrics_are_the_mean_over_loss_tokens():
    cfg = MGRPOConfig()
    exp = _exp([[-0.5, -2.5], [-0.5]], [[-1.0, -2.0], [-0.5]], [1.0, 0.0])
    exp.in_loss = [True, False]  # the second sample is out of the loss: it counts in no metric
    m = exp.opd_metrics(cfg.algorithm.opd)
    assert m["opd/tokens"] == 2.0
    assert m["opd/reverse_kl"] == pytest.approx(0.0)  # -0.5 and +0.5
    assert m["opd/reverse_kl_max"] == pytest.approx(0.5) and m["opd/reverse_kl_min"] == pytest.approx(-0.5)
    assert m["opd/teacher_better_frac"] == pytest.approx(0.5)


def _teacher_dir(tmp_path, model: ModelConfig, tokenizer=None) -> str:
    from mgrpo.models.hf_io import init_hf_checkpoint

    return init_hf_checkpoint(str(tmp_path / "teacher"), model, seed=3, tokenizer=tokenizer)


def test_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    from mgrpo.preflight import teacher_errors
    from mgrpo.data.printable import printable_tokenizer

    printable = ModelConfig(tokenizer="printable", vocab_size=107)
    cfg = MGRPOConfig()  # the student: the synthetic tokenizer, 16 tokens
    cfg.teacher.hf_path = _teacher_dir(tmp_path, printable, printable_tokenizer())
    errors = teacher_errors(cfg)
    assert any("vocab_size=107" in e and "model.vocab_size=16" in e for e in errors), errors
    assert any("vocabulary (" in e and cfg.teacher.hf_path in e and "model.tokenizer='synthetic'" in e
               for e in errors), errors
    assert any("chat template differs" in e for e in errors), errors


def test_wider_teacher_with_the_students_tokenizer_is_accepted_and_planned(tmp_path):
    from mgrpo.preflight import teacher_errors
    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.plan.memory import estimate, param_counts

    wide = ModelConfig(hidden_size=192, ffn_hidden_size=384, num_layers=3)
    cfg = MGRPOConfig()
    cfg.teacher.hf_path = _teacher_dir(tmp_path, wide, synthetic_tokenizer())
    assert teacher_errors(cfg) == []
    cfg.trainer.device = "cpu"
    mem = estimate(cfg)
    teacher_params = param_counts(dataclasses.replace(wide, hf_path=None), 1, 1)["per_rank_by_stage"][0]
    assert mem.terms["teacher_weights"] == teacher_params * 4  # fp32 on CPU
    assert "teacher_weights" not in estimate(MGRPOConfig()).terms
    cfg.actor.pp = 2  # 3 layers do not split over 2 stages: refused for the Megatron teacher
    assert any("do not split over actor.pp=2" in e for e in teacher_errors(cfg))


def test_distillation_without_a_teacher_and_sglang_teacher_limits_are_refused(tmp_path):
    from mgrpo.preflight import teacher_errors

    cfg = MGRPOConfig()
    cfg.algorithm.adv_estimator = "none"
    assert any("teacher.hf_path is not set" in e for e in teacher_errors(cfg))
    cfg.teacher.hf_path = str(tmp_path / "missing")
    assert any("teacher.hf_path=" in e and "does not exist" in e for e in teacher_errors(cfg))
    cfg = MGRPOConfig()
    cfg.teacher.hf_path = _teacher_dir(tmp_path, ModelConfig())
    cfg.teacher.mode = "sglang"
    cfg.rollout.temperature = 0.7
    assert any("untempered" in e for e in teacher_errors(cfg))


def test_cpu_server_input_token_logprobs_equal_a_transformers_forward(tmp_path):
    from mgrpo.rollout.sglang.cpu import generate as cpu_generate
    from mgrpo.rollout.sglang.cpu.model import CPUModel
    from tests.helpers.sglang_cpu import Reference, tiny_checkpoint

    hf = tiny_checkpoint(str(tmp_path))
    model, ref = CPUModel(hf), Reference(hf)
    limits = cpu_generate.Limits(vocab_size=16, context_len=256)
    seqs = [[1, 5, 6, 7, 2, 9, 3], [4, 4, 8, 11, 12], [2, 3]]
    starts = [3, 0, 1]
    body = {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": starts}
    reqs, _, logprob = cpu_generate.parse(body, limits)
    done = model.generate(reqs)
    for seq, start, r in zip(seqs, starts, done):
        got = cpu_generate.answer(r, "0", True, 0.0)["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in got] == seq[start:]
        assert got[0][0] is None  # SGLang's first input position has no log-prob
        logits = ref.model(torch.tensor([seq])).logits[0].float()
        want = torch.log_softmax(logits, -1)[torch.arange(start, len(seq) - 1), torch.tensor(seq[start + 1:], dtype=torch.long)]
        assert len(got) - 1 == len(want)
        assert max((abs(v - w) for (v, _, _), w in zip(got[1:], want.tolist())), default=0.0) < 1e-5
    # without logprob_start_len: output log-probs only, and SGLang's empty input list
    reqs, _, _ = cpu_generate.parse({"input_ids": seqs[0], "sampling_params": {"max_new_tokens": 1},
                                     "return_logprob": True}, limits)
    assert cpu_generate.answer(model.generate(reqs)[0], "0", True, 0.0)["meta_info"]["input_token_logprobs"] == []
    with pytest.raises(cpu_generate.RequestError, match="is higher than the number of input tokens"):
        cpu_generate.parse({"input_ids": seqs[2], "return_logprob": True, "logprob_start_len": 5}, limits)


def test_cpu_server_input_top_logprobs_equal_a_transformers_forward(tmp_path):
    """top_logprobs_num with logprob_start_len: meta_info.input_top_logprobs as SGLang builds it (the first
    position None, then per input position top_logprobs_num [logprob, id, None] highest first)."""
    from mgrpo.rollout.sglang.cpu import generate as cpu_generate
    from mgrpo.rollout.sglang.cpu.model import CPUModel
    from tests.helpers.sglang_cpu import Reference, tiny_checkpoint

    hf = tiny_checkpoint(str(tmp_path))
    model, ref = CPUModel(hf), Reference(hf)
    limits = cpu_generate.Limits(vocab_size=16, context_len=256)
    seqs, starts = [[1, 5, 6, 7, 2, 9, 3], [4, 4, 8, 11, 12]], [3, 0]
    body = {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": starts, "top_logprobs_num": 5}
    reqs, _, _ = cpu_generate.parse(body, limits)
    for seq, start, r in zip(seqs, starts, model.generate(reqs)):
        meta = cpu_generate.answer(r, "0", True, 0.0)["meta_info"]
        top = meta["input_top_logprobs"]
        assert len(top) == len(meta["input_token_logprobs"]) == len(seq) - start and top[0] is None
        want_v, want_i = torch.log_softmax(ref.model(torch.tensor([seq])).logits[0].float(), -1)[
            start:len(seq) - 1].topk(5, -1)
        assert [[t for _, t, _ in row] for row in top[1:]] == want_i.tolist()
        assert max(abs(v - w) for row, wrow in zip(top[1:], want_v.tolist()) for (v, _, _), w in zip(row, wrow)) < 1e-5
        assert all(text is None for row in top[1:] for _, _, text in row)


def test_forward_kl_topk_refusals():
    from mgrpo.preflight import teacher_errors

    cfg = MGRPOConfig()
    cfg.algorithm.adv_estimator = "none"
    cfg.algorithm.opd.loss_mode = "forward_kl_topk"
    cfg.algorithm.opd.topk = 17  # the synthetic vocabulary has 16 tokens
    cfg.algorithm.logprob_support = "sampled"
    errors = teacher_errors(cfg)
    assert any("algorithm.opd.topk=17 must be between 1 and model.vocab_size=16" in e for e in errors)
    assert any("forward_kl_topk" in e and "algorithm.logprob_support=sampled" in e for e in errors)


def test_forward_kl_topk_leaves_the_advantages_to_the_reward():
    cfg = MGRPOConfig()
    cfg.algorithm.opd.loss_mode = "forward_kl_topk"
    exp = _exp([[-0.5, -2.5], [-0.5]], [[-1.0, -2.0], [-0.5]], [1.0, 0.0])
    exp.compute_advantages(cfg)  # GRPO alone: the teacher's term is a loss of its own, not an advantage
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(exp.advantages[0], [g, g], rtol=1e-5)
    np.testing.assert_allclose(exp.advantages[1], [-g], rtol=1e-5)
