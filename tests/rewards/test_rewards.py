"""Reward functions, the registry, the Rules's isolation (failures, timeouts, dying workers),
evaluation metrics and the mgrpo-reward command."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time

import pytest

from mgrpo.config import RewardConfig
from mgrpo.rewards import BUILTIN_REWARDS, Rules, ScoreRequest, check_data_sources, eval_metrics, to_score
from mgrpo.rewards.math_reward import compute_score as math_score
from mgrpo.rewards.registry import runs_in_process
from mgrpo.rewards.synthetic import sum_score


# --- built-in reward functions -------------------------------------------------------------------

# GSM8K (veRL's strict and flexible judges, format credit): tests/rewards/test_rewards_gsm8k.py


@pytest.mark.parametrize("response, truth, score", [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{(1,2)}", "(1, 2)", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("no answer", "4", 0.0),
])
def test_math_reward(response, truth, score):
    assert math_score("math", response, truth, None) == score


def test_sum_reward():
    stop, cut = {"finish_reason": "stop"}, {"finish_reason": "length"}
    assert sum_score("mgrpo/sum", "7", "7", stop) == 1.0
    assert sum_score("mgrpo/sum", "7<eos>", "7", stop) == 1.0   # decoded without skipping specials
    assert sum_score("mgrpo/sum", "7", "7", cut) == 0.0         # no EOS: the model did not stop
    assert sum_score("mgrpo/sum", "77", "7", stop) == 0.0
    assert sum_score("mgrpo/sum", "8", "7", stop) == 0.0
    with pytest.raises(ValueError, match="finish_reason"):
        sum_score("mgrpo/sum", "7", "7", None)


def test_to_score():
    assert to_score({"score": 1, "acc": True}) == 1.0 and to_score(True) == 1.0 and to_score(0) == 0.0
    for bad in ("1", None, float("nan"), {"acc": 1}):
        with pytest.raises(ValueError):
            to_score(bad)


# --- registry ------------------------------------------------------------------------------------

def test_builtin_sources():
    for src in ("openai/gsm8k", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math_dapo",
                "mgrpo/sum"):
        assert src in BUILTIN_REWARDS


def test_unknown_data_source_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"no reward function for data_source 'my/data'; known: \[.*'openai/gsm8k'"):
        check_data_sources({"openai/gsm8k", "my/data"}, RewardConfig())
    check_data_sources({"openai/gsm8k", "mgrpo/sum"}, RewardConfig())


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user reward module on sys.path (worker processes inherit it through PYTHONPATH)."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        import os, time

        def exact(data_source, solution_str, ground_truth, extra_info=None):
            print("user functions may print; the worker protocol must not care")
            return {"score": float(solution_str.strip() == ground_truth), "extra": 1}

        def boom(data_source, solution_str, ground_truth, extra_info=None):
            raise RuntimeError("reward bug")

        def slow(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(float(solution_str))
            return 1.0

        def crash(data_source, solution_str, ground_truth, extra_info=None):
            os._exit(7)

        def text(data_source, solution_str, ground_truth, extra_info=None):
            return "high"
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("exact", "boom", "slow", "crash", "text")
    return {f"my/{n}": f"my_rewards:{n}" for n in names}


def test_custom_functions_and_bad_specs(user_module):
    check_data_sources({"my/exact"}, RewardConfig(custom_functions=user_module))
    with pytest.raises(ValueError, match=r"reward.custom_functions\['x'\]='no_such_mod:f': cannot import"):
        check_data_sources({"x"}, RewardConfig(custom_functions={"x": "no_such_mod:f"}))
    with pytest.raises(ValueError, match="has no function 'nope'"):
        check_data_sources({"x"}, RewardConfig(custom_functions={"x": "my_rewards:nope"}))


def test_a_reward_file_needs_no_pythonpath(tmp_path, monkeypatch):
    """'path/to/file.py:function', relative to where the run starts or absolute, imports the file itself; the
    worker's spec is absolute, so another working directory finds the same file."""
    from mgrpo.rewards.registry import absolute_spec, load_function

    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "mine.py").write_text("def score(ds, s, gt, extra=None):\n    return float(s == gt) + 0.5\n")
    monkeypatch.chdir(tmp_path)
    fn = load_function("rw/mine.py:score", "x")
    assert fn("x", "4", "4", None) == 1.5 and fn("x", "3", "4", None) == 0.5
    assert absolute_spec("rw/mine.py:score") == f"{tmp_path}/rw/mine.py:score"
    assert absolute_spec("pkg.mod:score") == "pkg.mod:score"
    assert load_function(absolute_spec("rw/mine.py:score"), "x") is fn  # one module per file
    with pytest.raises(ValueError, match=r"reward.custom_functions\['x'\]='rw/none.py:score': cannot import "
                                         r"'rw/none.py' \(FileNotFoundError: no file .*rw/none.py\)"):
        load_function("rw/none.py:score", "x")
    with pytest.raises(ValueError, match=r"cannot import 'no_pkg.rewards' .* on PYTHONPATH, or installed\), or give "
                                         r"its file: 'no_pkg/rewards.py:score'"):
        load_function("no_pkg.rewards:score", "x")


def test_every_source_entry_is_verls_custom_reward_function(tmp_path):
    """'*' scores every data_source without a function of its own, built-ins included (veRL's custom function
    replaces its default scorer); a data_source with its own entry keeps it."""
    from mgrpo.rewards.registry import get_reward_fn, reward_functions

    (tmp_path / "r.py").write_text("def one(*a):\n    return 1.0\n\ndef two(*a):\n    return 2.0\n")
    cfg = RewardConfig(custom_functions={"*": f"{tmp_path}/r.py:one", "mine": f"{tmp_path}/r.py:two"})
    fns = reward_functions(cfg)
    assert get_reward_fn("openai/gsm8k", fns)("openai/gsm8k", "#### 72", "72", None) == 1.0
    assert get_reward_fn("anything/else", fns)("anything/else", "", "", None) == 1.0
    assert get_reward_fn("mine", fns)("mine", "", "", None) == 2.0
    check_data_sources({"openai/gsm8k", "anything/else"}, cfg)  # nothing is unknown


def test_a_reward_function_is_called_once_at_start_on_a_record(user_module):
    """An exception or a return value that is not a score is one line at start naming the entry and the record,
    not a failure per sample mid-run."""
    cfg = RewardConfig(custom_functions=user_module)
    sample = ("data/train.jsonl:7", "5", {"k": 1})
    check_data_sources({"my/exact", "openai/gsm8k"}, cfg, samples={"my/exact": sample, "openai/gsm8k": sample})
    with pytest.raises(ValueError, match=r"reward.custom_functions\['my/boom'\]='my_rewards:boom', called once at "
                                         r"start on the record at data/train.jsonl:7 with an empty response: "
                                         r"RuntimeError: reward bug"):
        check_data_sources({"my/boom"}, cfg, samples={"my/boom": sample})
    with pytest.raises(ValueError, match=r"\['my/text'\].*ValueError: reward function returned a string \('high'\)"):
        check_data_sources({"my/text"}, cfg, samples={"my/text": sample})


# --- the Rules ----------------------------------------------------------------------------------

def _requests():
    return [
        ScoreRequest("openai/gsm8k", "#### 72", "72"),
        ScoreRequest("my/exact", " 5 ", "5"),
        ScoreRequest("my/boom", "", "1"),
        ScoreRequest("my/slow", "30", "1"),           # would take 30 s: must be cut at the timeout
        ScoreRequest("mgrpo/sum", "7", "7", {"finish_reason": "stop"}),
        ScoreRequest("my/text", "", "1"),
        ScoreRequest("math", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        ScoreRequest("my/crash", "", "1"),            # kills its worker process
        ScoreRequest("openai/gsm8k", "#### 71", "72"),
        ScoreRequest("my/slow", "0.01", "1"),
    ]


@pytest.mark.integration
def test_judger_workers_isolate_failures_and_timeouts(user_module):
    # a worker warms math-verify (sympy) before it says it is ready, so 5 s time the calls, not that import
    cfg = RewardConfig(custom_functions=user_module, timeout_s=5.0, num_workers=2)
    with Rules(cfg) as judger:
        t0 = time.monotonic()
        res = judger.score(_requests())
        assert time.monotonic() - t0 < 20       # the 30 s call was cut off
        assert res.scores == [1.0, 1.0, None, None, 1.0, None, 1.0, None, 0.0, 1.0]  # a failure is no score
        assert res.failed_by == ["", "", "rule:my/boom", "rule:my/slow", "", "rule:my/text", "", "rule:my/crash", "",
                                 ""]
        assert res.status == ["ok", "ok", "failed", "timeout", "ok", "failed", "ok", "failed", "ok", "ok"]
        assert (res.failed, res.timeout) == (3, 1)
        assert any("reward bug" in e for e in res.errors)
        assert any("exited (code 7) twice" in e for e in res.errors)  # my/crash ran on two workers
        assert res.metrics() == {"reward/failed": 3.0, "reward/timeouts": 1.0, "reward/worker_restarts": 2.0}
        # replaced workers keep serving the next batch
        again = judger.score([ScoreRequest("openai/gsm8k", "#### 1", "1")] * 50)
        assert again.scores == [1.0] * 50 and again.failed == again.timeout == 0


@pytest.mark.integration
def test_judger_sends_one_message_per_worker_per_call(monkeypatch):
    """A step's requests reach each worker as one message (not one round trip per response), and the
    answers come back to the right requests."""
    from mgrpo.rewards import rules as judger_mod

    sent = []
    real = judger_mod._Worker.send_todo
    monkeypatch.setattr(judger_mod._Worker, "send_todo", lambda w, reqs: (sent.append(len(w.todo)), real(w, reqs)))
    reqs = [ScoreRequest("openai/gsm8k", f"#### {i % 7}", str(i % 5)) for i in range(301)]
    with Rules(RewardConfig(num_workers=2, isolate_builtin_rules=True)) as judger:
        res = judger.score(reqs)
        assert sorted(sent) == [150, 151]
        assert res.scores == [float(i % 7 == i % 5) for i in range(301)] and res.status == ["ok"] * 301
        judger.score(reqs[:3])
        assert sorted(sent[2:]) == [1, 2]


@pytest.mark.integration
def test_judger_replaces_a_worker_that_died_while_idle():
    with Rules(RewardConfig(num_workers=1, isolate_builtin_rules=True)) as judger:
        assert judger.score([ScoreRequest("openai/gsm8k", "#### 1", "1")]).scores == [1.0]
        w = judger._workers[0]
        w.proc.kill()   # our own child; simulates an OOM kill between steps
        w.proc.wait()
        res = judger.score([ScoreRequest("openai/gsm8k", "#### 1", "1")] * 3)
        assert res.scores == [1.0] * 3 and res.failed == 0 and res.worker_restarts == 1


@pytest.mark.integration
def test_judger_worker_killed_during_a_call_costs_no_score(user_module):
    """A worker killed from outside while it runs a call (as an OOM kill or a chaos run does): the call and
    the ones queued behind it are scored by a fresh worker, exactly as if nothing had happened; the
    restart is counted."""
    import signal

    reqs = [ScoreRequest("my/slow", "0.5", "1"), ScoreRequest("my/exact", "3", "3"),
            ScoreRequest("my/exact", "3", "4")]
    with Rules(RewardConfig(custom_functions=user_module, timeout_s=30.0, num_workers=1)) as judger:
        judger.score([ScoreRequest("my/exact", "1", "1")])  # the worker is up
        pid = judger._workers[0].proc.pid
        killer = threading.Timer(0.2, os.kill, (pid, signal.SIGKILL))  # lands inside the 0.5 s call
        killer.start()
        res = judger.score(reqs)
        killer.join()
    assert res.scores == [1.0, 1.0, 0.0] and res.status == ["ok"] * 3
    assert (res.failed, res.timeout, res.worker_restarts) == (0, 0, 1)


def test_judger_in_process(user_module):
    reqs = [r for r in _requests() if r.data_source != "my/crash"]
    reqs[3] = ScoreRequest("my/slow", "0.3", "1")   # in-process calls cannot be cut: only counted
    with Rules(RewardConfig(custom_functions=user_module, timeout_s=0.2, num_workers=0)) as judger:
        res = judger.score(reqs)
    assert res.scores == [1.0, 1.0, None, None, 1.0, None, 1.0, 0.0, 1.0]
    assert (res.failed, res.timeout) == (2, 1)


def test_builtin_string_rules_run_in_process_without_workers():
    """With workers configured, the built-in string rules are scored in the calling process and no worker starts
    (a unit test: starting one would fail it); a user function replacing a built-in, '*', math-verify and
    reward.isolate_builtin_rules send a source to the workers."""
    reqs = [ScoreRequest("mgrpo/sum", "7", "7", {"finish_reason": "stop"}),
            ScoreRequest("mgrpo/sum", "7", "8", {"finish_reason": "stop"}),
            ScoreRequest("mgrpo/sum", "7", "7", {"finish_reason": "length"}),
            ScoreRequest("openai/gsm8k", "#### 71", "72"), ScoreRequest("openai/gsm8k", "so #### 72", "72"),
            ScoreRequest("mgrpo/sum", "7", "7")]  # no finish_reason: the rule raises, a failure, not a 0
    with Rules(RewardConfig(num_workers=2)) as judger:
        res = judger.score(reqs)
        assert judger._workers == []
    assert res.scores == [1.0, 0.0, 0.0, 0.0, 1.0, None] and res.status == ["ok"] * 5 + ["failed"]
    assert res.failed_by[5] == "rule:mgrpo/sum" and res.metrics()["reward/failed"] == 1.0
    default = RewardConfig()
    assert [runs_in_process(s, default) for s in ("mgrpo/sum", "mgrpo/peek", "openai/gsm8k", "math", "my/exact")] \
        == [True, True, True, False, False]
    assert not runs_in_process("mgrpo/sum", RewardConfig(isolate_builtin_rules=True))
    assert not runs_in_process("openai/gsm8k", RewardConfig(custom_functions={"openai/gsm8k": "m:f"}))
    assert not runs_in_process("mgrpo/sum", RewardConfig(custom_functions={"*": "m:f"}))


@pytest.mark.integration
def test_judger_unknown_source_at_score_time_is_counted():
    with Rules(RewardConfig(num_workers=1)) as judger:
        res = judger.score([ScoreRequest("nobody/knows", "x", "y"), ScoreRequest("openai/gsm8k", "#### 2", "2")])
    assert res.scores == [None, 1.0] and res.failed == 1 and "nobody/knows" in res.errors[0]


# --- evaluation metrics --------------------------------------------------------------------------

def test_eval_metrics_by_hand():
    # gsm8k: prompt 0 samples [1, 0], prompt 1 [0, 0]; math: prompt 2 [1, 1]
    scores = [1, 0, 0, 0, 1, 1]
    groups = [0, 0, 1, 1, 2, 2]
    sources = ["openai/gsm8k"] * 4 + ["math"] * 2
    m = eval_metrics(scores, groups, sources, n=2)
    assert m == {
        "val/math/score": 1.0, "val/math/mean@2": 1.0, "val/math/pass@2": 1.0,
        "val/openai/gsm8k/score": 0.25, "val/openai/gsm8k/mean@2": 0.25, "val/openai/gsm8k/pass@2": 0.5,
    }
    # partial credit (0.5) is not a pass
    assert eval_metrics([0.5, 0.5], [0, 0], ["s", "s"], 2)["val/s/pass@2"] == 0.0


# --- mgrpo-reward --------------------------------------------------------------------------------

@pytest.mark.integration
def test_reward_cli(tmp_path, capsys, user_module):
    from mgrpo_launchers.reward import main

    inp, out = tmp_path / "responses.jsonl", tmp_path / "scored.jsonl"
    rows = [{"data_source": "openai/gsm8k", "response": "#### 72", "ground_truth": "72", "id": "a"},
            {"data_source": "openai/gsm8k", "response": "#### 7", "ground_truth": 72},
            {"data_source": "mgrpo/sum", "response": "3", "ground_truth": "3", "extra_info": {"finish_reason": "stop"}},
            {"data_source": "my/boom", "response": "", "ground_truth": "1"}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--in", str(inp), "--out", str(out), "--custom", "my/boom=my_rewards:boom"]) == 0
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in scored] == [1.0, 0.0, 1.0, None]  # the failed call: null, not 0
    assert scored[0]["id"] == "a" and scored[3]["reward_status"] == "failed"
    assert "mean score 0.6667 (of 3 scored), failed 1, timeout 0" in capsys.readouterr().out

    inp.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"data_source": "openai/gsm8k", "response": "x"}) + "\n")
    assert main(["--in", str(inp), "--out", str(out)]) == 2
    assert "responses.jsonl:2: field 'ground_truth' (or 'reward_model.ground_truth') missing" in capsys.readouterr().err
    inp.write_text(json.dumps({**rows[0], "data_source": "who/knows"}) + "\n")
    assert main(["--in", str(inp), "--out", str(out)]) == 2
    assert "'who/knows'" in capsys.readouterr().err
