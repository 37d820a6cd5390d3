"""A sample whose reward could not be produced is not a label: no score, out of the loss and out of its group's
baseline, its group dropped or re-judged when too few remain, counted per judge, a warning past a rate and a
refusal past another. The numbers are checked against group statistics computed by hand (statistics module)."""

from __future__ import annotations

import logging
import statistics

import pytest

from mgrpo.rewards import failed as failed_samples
from mgrpo.algorithms.filtering import GroupAccumulator
from mgrpo.config import MGRPOConfig
from mgrpo.data.dataset import PromptItem
from mgrpo.data.synthetic import synthetic_tokenizer
from mgrpo.components.experience_maker import judge_experience
from mgrpo.experience import Experience
from mgrpo.rewards import Rules, eval_metrics
from tests.helpers import reward_fns

SOURCE = "mgrpo/flaky"
FN = "tests.helpers.reward_fns:flaky_digit_reward"


def _experience(tok, groups: list[list[str]]) -> Experience:
    """One prompt per group; each response the given digits, then EOS (finish 'stop')."""
    items = [PromptItem(index=g, prompt_ids=tok.encode("1+1="), prompt_text="1+1=", data_source=SOURCE,
                        ground_truth="2") for g in range(len(groups))]
    texts = [t for g in groups for t in g]
    n = len(groups[0])
    ids = [tok.encode(t) + [tok.eos_token_id] for t in texts]
    return Experience(prompt_ids=[items[i // n].prompt_ids for i in range(len(texts))], response_ids=ids,
                      rollout_logprobs=[[-1.0] * len(r) for r in ids], finish_reasons=["stop"] * len(texts),
                      weight_versions=[0] * len(texts), group_index=[i // n for i in range(len(texts))],
                      items=[items[i // n] for i in range(len(texts))], in_loss=[True] * len(texts))


def _cfg(**failed) -> MGRPOConfig:
    cfg = MGRPOConfig()
    cfg.reward.custom_functions = {SOURCE: FN}
    cfg.reward.num_workers = 0  # in-process: the same outcomes as the workers (tests/rewards/test_rewards.py)
    for k, v in failed.items():
        setattr(cfg.reward.failed, k, v)
    return cfg


def _grpo(scores: list[float]) -> list[float]:
    mean, std = statistics.fmean(scores), statistics.stdev(scores)
    return [(s - mean) / (std + 1e-6) for s in scores]


@pytest.fixture
def tok():
    reward_fns.FLAKY_CALLS.clear()
    return synthetic_tokenizer()


def test_failed_samples_leave_the_loss_and_the_baseline(tok, caplog):
    cfg = _cfg()
    exp = _experience(tok, [["1", "2", "3", "4"],     # all scored
                            ["1", "9", "3", "5"],     # one judge raised: baseline over 1, 3, 5
                            ["9", "8", "2", "9"],     # one left: dropped
                            ["6", "6", "4", "8"]])    # garbage answer: baseline over 6, 6, 4
    with Rules(cfg.reward) as judger, caplog.at_level(logging.WARNING, "mgrpo"):
        got = judge_experience(judger, exp, tok, cfg)
    assert exp.scores == [.1, .2, .3, .4, .1, None, .3, .5, None, None, .2, None, .6, .6, .4, None]
    assert [None if r is None else round(r, 6) for r in exp.rewards] == exp.scores  # None stays None, never 0.0
    assert exp.outcomes.count("failed") == 5 and exp.failed_by[5] == "rule:mgrpo/flaky"
    assert exp.reward_masked == [False] * 4 + [False, True, False, False] + [True] * 4 + [False] * 3 + [True]
    assert exp.in_loss == [not m for m in exp.reward_masked]
    assert got["reward/failed"] == 5 and got["reward/timeouts"] == 0
    assert got["reward/masked_samples"] == 6 and got["reward/dropped_groups"] == 1
    assert got["reward/failed/rule:mgrpo/flaky"] == 5
    assert "5 of 16 samples (31%) have no reward (rule:mgrpo/flaky 5)" in caplog.text  # past warn_rate=0.05

    exp.compute_advantages(cfg)
    adv = [a[0] for a in exp.advantages]
    want = _grpo([.1, .2, .3, .4]) + [None] * 4 + [None] * 4 + _grpo([.6, .6, .4]) + [None]
    b = _grpo([.1, .3, .5])
    want[4], want[6], want[7] = b
    for i, (a, w) in enumerate(zip(adv, want)):
        assert a == pytest.approx(0.0 if w is None else w, abs=1e-6), i
    assert all(all(x == 0.0 for x in exp.advantages[i]) for i, m in enumerate(exp.reward_masked) if m)


def test_rejudge_rescues_a_short_group_and_the_refusal(tok, caplog):
    exp = _experience(tok, [["7", "7", "7", "2"], ["1", "2", "3", "4"]])
    cfg = _cfg(small_group="rejudge", rejudge_attempts=1)
    with Rules(cfg.reward) as judger:
        got = judge_experience(judger, exp, tok, cfg)
    assert reward_fns.FLAKY_CALLS["7"] == 6  # three failed calls, three again
    assert exp.scores[:4] == [.7, .7, .7, .2] and got["reward/rejudged"] == 3
    assert got["reward/masked_samples"] == 0 and got["reward/failed"] == 0 and not any(exp.reward_masked)

    # past reward.failed.max_rate a training batch is refused, naming the key; a validation only warns
    reward_fns.FLAKY_CALLS.clear()
    exp = _experience(tok, [["9", "9", "8", "2"], ["1", "2", "3", "4"]])
    cfg = _cfg(max_rate=0.3)
    with Rules(cfg.reward) as judger:
        with pytest.raises(failed_samples.FailureRateExceeded, match=r"3 of 8 samples \(38%\).*reward.failed.max_rate=0.3"):
            judge_experience(judger, exp, tok, cfg)
        with caplog.at_level(logging.WARNING, "mgrpo"):
            got = judge_experience(judger, exp, tok, cfg, training=False)
    assert got["reward/failed"] == 3 and "past reward.failed.warn_rate" in caplog.text


def test_a_producers_failure_is_not_judged_and_counted_under_its_name(tok):
    """The multi-turn path marks a sample whose generation or environment failed before judging."""
    exp = _experience(tok, [["1", "2", "3", "4"]])
    exp.mark_failed(2, "env_failed", "env:sandbox")
    cfg = _cfg()
    with Rules(cfg.reward) as judger:
        got = judge_experience(judger, exp, tok, cfg)
    assert "3" not in reward_fns.FLAKY_CALLS  # never sent to the judge
    assert exp.scores == [.1, .2, None, .4] and exp.outcomes[2] == "env_failed"
    assert got["reward/failed"] == 1 and got["reward/failed/env:sandbox"] == 1 and got["reward/masked_samples"] == 1
    exp.compute_advantages(cfg)
    assert [a[0] for a in exp.advantages] == pytest.approx(
        [_grpo([.1, .2, .4])[0], _grpo([.1, .2, .4])[1], 0.0, _grpo([.1, .2, .4])[2]], abs=1e-6)
    with pytest.raises(ValueError, match="cannot be 'ok'"):
        exp.mark_failed(0, "ok", "x")


def test_short_groups_and_counts_by_hand():
    ok, bad, slow = failed_samples.OK, "failed", failed_samples.TIMEOUT
    outcomes = [ok, bad, ok, ok, bad, bad, ok, slow, slow, ok]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]          # group 3: rollout.n=1, never short while scored
    assert failed_samples.short_groups(outcomes, groups, 2) == [1, 2]
    assert failed_samples.short_groups(outcomes, groups, 1) == []
    assert failed_samples.short_groups([bad], [7], 2) == [7]  # a group of one that failed has nothing left
    flags = failed_samples.masked(outcomes, groups, [1, 2])
    assert flags == [False, True, False, True, True, True, True, True, True, False]
    sources = ["", "rule:a", "", "", "rule:a", "model:rm", "", "model:rm", "model:rm", ""]
    assert failed_samples.failure_counts(outcomes, sources, flags, 2) == {
        "reward/failed": 3.0, "reward/timeouts": 2.0, "reward/masked_samples": 7.0, "reward/dropped_groups": 2.0,
        "reward/failed/rule:a": 2.0, "reward/failed/model:rm": 1.0, "reward/timeouts/model:rm": 2.0}


def test_dynamic_sampling_and_validation_skip_missing_scores():
    acc = GroupAccumulator(train_batch_size=8)
    # group 0: 1 and a failure -> one value, no signal; group 1: 0 and 1 -> signal
    assert acc.add(["a", "b", "c", "d"], [1.0, None, 0.0, 1.0], [0, 0, 1, 1]) == 1
    assert acc.metrics()["dynamic_sampling/score_all_mean"] == pytest.approx(2 / 3)
    out = eval_metrics([1.0, None, 0.0, 0.0], [0, 0, 1, 1], ["s"] * 4, 2)
    assert out == {"val/s/failed": 1.0, "val/s/score": pytest.approx(1 / 3), "val/s/mean@2": 0.5, "val/s/pass@2": 0.5}


def test_a_failure_rate_past_the_limit_is_one_line_naming_the_keys_to_change():
    from mgrpo.config import InputError

    outcomes = ["failed"] * 3 + ["ok"]
    by = ["judge:j"] * 3 + [""]
    errors = ["judge:j: unparsed answer: neither the yes token (5) nor the no token (6) is among the 5 most likely\n"
              "first tokens; raise reward.models.j.judge.top_logprobs=5 (the yes/no tokens must be among the first "
              "token's most likely), or change reward.models.j.judge.yes='Y' / reward.models.j.judge.no='N'"]
    with pytest.raises(failed_samples.FailureRateExceeded) as got:
        failed_samples.check_rate(outcomes, by, warn_rate=0.1, max_rate=0.5, enforce=True,
                                  log=logging.getLogger("t"), errors=errors)
    line = str(got.value)
    # the launchers print an InputError as one line and exit 2 (no traceback)
    assert isinstance(got.value, InputError) and "\n" not in line
    assert line.startswith("3 of 4 samples (75%) have no reward (judge:j 3), past reward.failed.max_rate=0.5")
    assert "Change reward.models.j.judge.top_logprobs, reward.models.j.judge.yes, reward.models.j.judge.no, " \
           "reward.models.j.judge (or raise reward.failed.max_rate) and resume" in line
    # a rule's failures name the rule's keys
    with pytest.raises(failed_samples.FailureRateExceeded, match=r"Change reward.custom_functions / reward.timeout_s "):
        failed_samples.check_rate(["timeout"] * 2, ["rule:mgrpo/sum"] * 2, warn_rate=0.1, max_rate=0.5, enforce=True,
                                  log=logging.getLogger("t"))


def test_the_asynchronous_producer_hands_a_refusal_on_as_it_is():
    """The producer thread's FailureRateExceeded reaches the loop (and the launcher's one line) unwrapped."""
    from mgrpo.components.rollout_pipeline import RolloutPipeline

    def produce(index):
        raise failed_samples.FailureRateExceeded("8 of 8 samples (100%) have no reward; Change reward.models.j.judge")

    pipe = RolloutPipeline(produce, max_staleness=1)
    pipe.start()
    try:
        with pytest.raises(failed_samples.FailureRateExceeded, match="Change reward.models.j.judge"):
            pipe.next(current_version=0)
    finally:
        pipe.close()
