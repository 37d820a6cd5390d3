"""mgrpo-doctor run on run folders whose mismatch is known by construction, and its refusals of bad input.

Each folder is written here with trajectory lines whose rollout and trainer log-probs differ by chosen
amounts, so every number the report prints has a hand-computed answer: per-step means (and their agreement
with the run's own rollout/logprob_abs_diff), the worst sequence and its position, and which dimension the
difference concentrates in (one engine, the late positions, one token, long responses) or none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mgrpo.doctor import DoctorError
from mgrpo.doctor.run_report import analyse, render, verdict_line


def _line(step, prompt, response, diffs, engine=0, base=-1.0):
    rollout = [base - 0.1 * k for k in range(len(response))]
    return {"step": step, "prompt": "p", "response": "r", "weight_version": step - 1, "engine": engine,
            "prompt_ids": prompt, "response_ids": response, "rollout_logprobs": rollout,
            "trainer_logprobs": [r + d for r, d in zip(rollout, diffs)]}


def write_run(path, rows, metrics=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "trajectories.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if metrics is not None:
        with open(os.path.join(path, "metrics.jsonl"), "w") as f:
            for step, value in metrics.items():
                f.write(json.dumps({"step": step, "rollout/logprob_abs_diff": value}) + "\n")
    return str(path)


def test_one_engine_that_disagrees_is_named_and_the_steps_match_the_metric(tmp_path):
    rows = []
    for step in (1, 2, 3):
        for s in range(8):  # engine 1 serves half the samples and is 10x off
            engine = s % 2
            d = 1e-6 * step * (10 if engine else 1)
            rows.append(_line(step, [1, 2, 3], [4, 5, 6, 7], [d, d, d, d], engine=engine))
    rows[13]["trainer_logprobs"][2] += 0.5  # step 2, sample 5 (line 14): the worst token, at position 2
    expected = {}
    for step in (1, 2, 3):
        tokens = [abs(t - r) for row in rows if row["step"] == step
                  for r, t in zip(row["rollout_logprobs"], row["trainer_logprobs"])]
        expected[step] = sum(tokens) / len(tokens)
    run = write_run(tmp_path / "run", rows, metrics=expected)
    rep = analyse(run)

    assert rep["lines"] == 24 and rep["steps"] == 3 and rep["tokens"]["count"] == 96
    for row in rep["per_step"]:
        assert row["mean"] == pytest.approx(expected[row["step"]], rel=1e-9)
    assert rep["metric_agreement"] < 1e-9 and rep["metric_steps_checked"] == 3
    w = rep["worst"][0]
    assert (w["line"], w["step"], w["worst_position"], w["worst_token"]) == (14, 2, 2, 6)
    assert w["max"] == pytest.approx(0.5 + 2e-5, rel=1e-6)
    c = rep["concentration"]
    assert c["engine"]["concentrated"] and c["engine"]["group"] == "1"
    assert not c["position"]["concentrated"] and not c["length"]["concentrated"]
    text = render(rep)
    assert "CONCENTRATED in engine 1" in text and "line 14, step 2, engine 1" in text
    # no actor.dtype in this folder (no checkpoint): the largest step mean is reported, not judged
    assert text.splitlines()[-1].startswith("verdict: UNJUDGED: largest step mean |diff| ")
    assert text.splitlines()[-1].endswith("; concentrated in engine 1")
    judged = dict(rep, actor_dtype="fp32", default_bound=1e-3)
    line = verdict_line(judged)
    assert line.startswith("verdict: DISAGREE: step 2's mean |diff| ") and "over the guard's bound 0.001" in line
    assert verdict_line(dict(judged, default_bound=0.1)).startswith("verdict: AGREE: every step's mean |diff| is")


def test_growth_with_position_concentrates_late_and_a_uniform_run_is_spread(tmp_path):
    # a RoPE-like fault: the difference grows with the position in the response
    rows = [_line(1, [1, 2], list(range(3, 19)), [1e-7 * (1 + p) ** 2 for p in range(16)]) for _ in range(10)]
    rep = analyse(write_run(tmp_path / "rope", rows))
    pos = rep["concentration"]["position"]
    assert pos["concentrated"] and pos["group"] == "8-15"
    assert [g["group"] for g in pos["groups"]] == ["0", "1", "2-3", "4-7", "8-15"]
    assert rep["concentration"]["engine"]["groups"][0]["ratio"] == pytest.approx(1.0)
    assert rep["metric_agreement"] is None  # no metrics.jsonl: nothing to check against

    # one token id whose row is wrong: the difference sits on that token wherever it appears
    rows = [_line(1, [1, 2], [3, 9, 4, 9, 5, 6], [1e-7, 1e-3, 1e-7, 1e-3, 1e-7, 1e-7]) for _ in range(10)]
    tok = analyse(write_run(tmp_path / "token", rows))["concentration"]["token"]
    assert tok["concentrated"] and tok["group"] == "9"

    # a bf16-like spread: the same size everywhere
    rows = [_line(s, [1], [2 + (k % 7) for k in range(n)], [1e-2] * n) for s in (1, 2) for n in (3, 5, 9, 17)]
    rep = analyse(write_run(tmp_path / "flat", rows))
    assert not any(c["concentrated"] for c in rep["concentration"].values())
    assert rep["tokens"]["mean"] == pytest.approx(1e-2, rel=1e-6)


def test_missing_log_probs_are_counted_not_averaged(tmp_path):
    rows = [_line(1, [1], [2, 3, 4], [1e-6, 1e-6, 1e-6]) for _ in range(4)]
    rows[0]["rollout_logprobs"][1] = None  # SGLang's answer for a log-prob it could not compute
    rows.append({"step": 1, "prompt": "p", "response": "r"})  # a line from before the option was on
    rep = analyse(write_run(tmp_path / "run", rows))
    assert rep["nonfinite_tokens"] == 1 and rep["tokens"]["count"] == 11 and rep["lines_without_tokens"] == 1
    assert rep["tokens"]["max"] == pytest.approx(1e-6, rel=1e-6)


def _multi_turn_line(step, late):
    """[assistant 3 tokens][tool 2 context tokens][assistant 3 tokens]: the second turn `late` off."""
    row = _line(step, [1], [4, 5, 6, 7, 8, 9, 10, 11], [1e-7] * 3 + [0.0, 0.0] + [late] * 3)
    row["sampled_mask"] = [1, 1, 1, 0, 0, 1, 1, 1]
    row["rollout_logprobs"][3:5] = [0.0, 0.0]  # context: no engine log-prob, written as 0.0
    row["trainer_logprobs"][3:5] = [-2.0, -3.0]
    row["multi_turn"] = {"finish_reason": "stop", "turns": [
        {"role": "assistant", "span": [0, 3]}, {"role": "tool", "span": [3, 5]}, {"role": "assistant", "span": [5, 8]}]}
    return row


def test_multi_turn_mismatch_is_reported_per_assistant_turn(tmp_path):
    # a fault that grows with the context the tool replies add: the second turn is 100x off, the context
    # tokens (no engine log-prob) are neither averaged nor counted as missing
    rows = [_multi_turn_line(s, 1e-5) for s in (1, 2) for _ in range(6)]
    rep = analyse(write_run(tmp_path / "mt", rows))
    assert rep["tokens"]["count"] == 12 * 6 and rep["nonfinite_tokens"] == 0
    turn = rep["concentration"]["turn"]
    assert [g["group"] for g in turn["groups"]] == ["1", "2"] and [g["tokens"] for g in turn["groups"]] == [36, 36]
    assert turn["concentrated"] and turn["group"] == "2" and turn["ratio"] == pytest.approx(100, rel=1e-6)
    assert "CONCENTRATED in turn 2" in render(rep)
    # single-turn lines have no turn dimension
    assert "turn" not in analyse(write_run(tmp_path / "st", [_line(1, [1], [2, 3], [0.0, 0.0])]))["concentration"]
    bad = _multi_turn_line(1, 0.0)
    bad["multi_turn"]["turns"][2]["span"] = [5, 9]
    with pytest.raises(DoctorError, match=r"trajectories.jsonl:1: multi_turn.turns\[2\].span must be \[start, end\] "
                                          r"within the 8 response tokens, got \[5, 9\]"):
        analyse(write_run(tmp_path / "bad", [bad]))


@pytest.mark.integration
@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("no_file", "has no trajectories.jsonl"),
    ("no_tokens", "no token log-probs"),
    ("short", "rollout_logprobs has 2 values for 3 response_ids"),
    ("half", "has prompt_ids, response_ids but not rollout_logprobs, trainer_logprobs"),
    ("json", "not valid JSON"),
])
def test_bad_input_is_one_message_and_exit_2(tmp_path, case, message):
    run = tmp_path / "run"
    good = _line(1, [1], [2, 3, 4], [0.0, 0.0, 0.0])
    if case == "no_file":
        os.makedirs(run)
    elif case == "no_tokens":
        write_run(run, [{"step": 1, "prompt": "p", "response": "r"}])
    elif case == "short":
        write_run(run, [good, {**good, "rollout_logprobs": [0.0, 0.0]}])
    elif case == "half":
        write_run(run, [{k: v for k, v in good.items() if k not in ("rollout_logprobs", "trainer_logprobs")}])
    elif case == "json":
        write_run(run, [good])
        with open(run / "trajectories.jsonl", "a") as f:
            f.write('{"step": 2, "prompt_ids": [1\n')
    with pytest.raises(DoctorError, match=message):
        analyse(str(run))
    out = subprocess.run([sys.executable, "-m", "mgrpo_launchers.doctor", "run", str(run)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and message.split(" (")[0] in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2
    if case in ("short", "json"):
        assert "trajectories.jsonl:2" in out.stderr  # the file and line


def test_rounding_sized_differences_are_agreement_not_a_concentration(tmp_path):
    # a float32 run: 1e-7 everywhere but 3e-7 on the late positions, a 3x ratio of rounding noise
    rows = [_line(1, [1, 2], list(range(3, 19)), [1e-7] * 8 + [3e-7] * 8) for _ in range(10)]
    rep = analyse(write_run(tmp_path / "fp32", rows))
    pos = rep["concentration"]["position"]
    assert pos["ratio"] == pytest.approx(3.0, rel=1e-3)  # the ratio is still measured ...
    assert pos["agree"] and not pos["concentrated"]  # ... and called what it is
    text = render(rep)
    assert "CONCENTRATED" not in text and "by position  agreement (every group's median |diff| under 5e-06" in text
    assert "every token group agrees to under 5e-06 (rounding)" in verdict_line(rep)


def test_context_tokens_print_as_context_and_the_json_has_no_nan(tmp_path):
    rows = [_multi_turn_line(s, 1e-3) for s in (1, 2) for _ in range(3)]
    rep = analyse(write_run(tmp_path / "mt", rows))
    text = render(rep)
    assert "nan" not in text.lower()
    assert "|diff| [1e-07, 1e-07, 1e-07, ctx, ctx, 0.001, 0.001, 0.001]" in text
    worst = rep["worst"][0]
    assert worst["diffs"][3:5] == [None, None] and worst["sampled"] == [1, 1, 1, 0, 0, 1, 1, 1]
    json.dumps(rep, allow_nan=False)  # raises on any NaN or infinity left in the report


def test_a_run_over_the_token_cap_logs_a_sample_of_steps():
    from mgrpo.components.observer import LOG_TOKEN_LOGPROBS_AUTO_TOKENS, log_token_logprobs
    from mgrpo.config.schema import DataConfig, MGRPOConfig, RolloutConfig, TrainerConfig

    def period(batch, n, length, option=None):
        return log_token_logprobs(MGRPOConfig(data=DataConfig(train_batch_size=batch, max_response_length=length),
                                              rollout=RolloutConfig(n=n),
                                              trainer=TrainerConfig(log_token_logprobs=option)))

    assert LOG_TOKEN_LOGPROBS_AUTO_TOKENS == 16384
    assert period(8, 4, 512) == 1  # 16,384 tokens a step: every step
    assert period(8, 4, 513) == 2  # just over: every other step
    assert period(128, 5, 1024) == 40  # qwen3-8b-gsm8k-grpo: 655,360 tokens a step, one step in 40
    assert period(128, 5, 1024, True) == 1 and period(8, 4, 16, False) == 0


def test_a_run_killed_before_its_first_checkpoint_is_judged_by_its_config_yaml(tmp_path):
    run = write_run(tmp_path / "run", [_line(1, [1], [2, 3, 4], [1e-6] * 3) for _ in range(4)])
    assert "UNJUDGED" in verdict_line(analyse(run))
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write("actor:\n  dtype: fp32\nrollout:\n  temperature: 1.0\n")
    rep = analyse(run)
    assert rep["actor_dtype"] == "fp32" and rep["default_bound"] == 1e-3
    assert verdict_line(rep).startswith("verdict: AGREE: every step's mean |diff| is within the guard's bound")
